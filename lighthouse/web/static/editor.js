// The config editor: validate as you type (locally, then a dry run against the job's schema),
// preview the diff, save with If-Match, history and rollback.
"use strict";

(() => {
  const { el, api, parseJson, stringify, fmtTime, confirmButton, setStatus } = LH;
  const MAX_KEY = 256;
  const POLL_MS = 2000;
  const CHECK_DELAY_MS = 250; // dry run once typing pauses
  const $ = (id) => document.getElementById(id);

  let loaded = null; // {version, config, patchNow}: what the edit is based on (GET /api/config's pair)
  let edited = null; // the parsed editor content when valid, else null
  let liveVersion = null;
  let schema = null; // the job's JSON Schema (for key descriptions), null when it has none
  // The server's dry run of the current text: pending until it answers; blocked when it refuses.
  let check = { seq: 0, pending: false, blocked: false, violations: [] };
  let checkTimer = null;

  function validate(text) {
    let value;
    try {
      value = parseJson(text);
    } catch (err) {
      return { error: `Not valid JSON: ${err.message}` };
    }
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      return { error: `The config must be a JSON object, got ${value === null ? "null" : Array.isArray(value) ? "an array" : typeof value}.` };
    }
    for (const [key, v] of Object.entries(value)) {
      if (!key) return { error: "A key is empty." };
      if (key.length > MAX_KEY) return { error: `Key "${key.slice(0, 32)}…" is ${key.length} characters (max ${MAX_KEY}).` };
    }
    return { value };
  }

  function diff(before, after) {
    const rows = [];
    for (const key of Object.keys(after)) {
      if (!Object.hasOwn(before, key)) rows.push({ kind: "added", key, after: after[key] });
      else if (stringify(before[key]) !== stringify(after[key])) rows.push({ kind: "changed", key, before: before[key], after: after[key] });
    }
    for (const key of Object.keys(before)) {
      if (!Object.hasOwn(after, key)) rows.push({ kind: "removed", key, before: before[key] });
    }
    return rows;
  }

  function patchOf(rows) {
    const patch = Object.create(null);
    for (const r of rows) patch[r.key] = r.kind === "removed" ? null : r.after;
    return patch;
  }

  function stepValue() {
    const text = $("at-step").value.trim();
    if (!text) return { step: null };
    if (!/^[0-9]{1,15}$/.test(text)) return { error: "Apply at step must be a whole number (or empty for now)." };
    return { step: text };
  }

  function onInput() {
    const result = validate($("editor").value);
    const step = stepValue();
    edited = result.value || null;
    const rows = edited && loaded ? diff(loaded.config, edited) : null;
    if (rows && patching(step) && rows.some((r) => r.kind !== "removed" && r.after === null)) {
      result.error = step.step !== null
        ? "A change at a step is a merge patch, where null deletes a key: save null now, or remove the key."
        : "While a change scheduled ahead is pending, a save is a merge patch, where null deletes a key: remove the key instead.";
      edited = null;
    }
    clearTimeout(checkTimer);
    check = { seq: check.seq + 1, pending: false, blocked: false, violations: [] };
    if (result.error || step.error) {
      setValidation("error", result.error || step.error);
    } else if (!rows || rows.length === 0) {
      setValidation("ok", `Valid JSON object, ${Object.keys(edited).length} keys.`);
    } else {
      check.pending = true;
      setValidation("info", "Checking with the lighthouse…");
      const seq = check.seq;
      checkTimer = setTimeout(() => dryRun(seq), CHECK_DELAY_MS);
    }
    renderViolations();
    renderDiff(edited ? rows : null);
  }

  function setValidation(kind, text) {
    $("validation").className = `validation ${kind}`;
    $("validation").textContent = text;
  }

  // Whether Save sends only what the edit changes (a merge patch) rather than the whole text: at a
  // step, and while a change scheduled ahead is pending (the text holds its keys, which a whole
  // config saved now would apply before its step; the lighthouse refuses that).
  function patching(step) {
    return step.step !== null || Boolean(loaded && loaded.patchNow);
  }

  // The request Save would send; as a dry run it answers what Save would do, storing nothing.
  function request(dryRun) {
    const step = stepValue();
    const params = new URLSearchParams();
    if (dryRun) params.set("dry_run", "1");
    if (step.step !== null) params.set("effective_step", step.step);
    const comment = $("comment").value.trim();
    if (comment) params.set("comment", comment);
    if ($("allow-type-change").checked) params.set("allow_type_change", "1");
    // Now: the editor's own text replaces the config (numbers stay exactly as typed).
    // At a step (or now while a change scheduled ahead is pending): only what the edit changes
    // (removed keys as null), so edits made to other keys before that step are not undone when
    // it applies, and the pending change applies at its own step.
    const patch = patching(step);
    const body = patch ? stringify(patchOf(diff(loaded.config, edited))) : $("editor").value;
    const query = params.toString();
    return { method: patch ? "PATCH" : "PUT", path: "/api/config" + (query ? "?" + query : ""), body };
  }

  async function dryRun(seq) {
    if (seq !== check.seq || !edited) return;
    const req = request(true);
    let res;
    try {
      res = await api(req.method, req.path, req.body, { "If-Match": String(loaded.version) }, false);
    } catch {
      res = { ok: false, status: 0, data: { error: "the lighthouse cannot be reached" } };
    }
    if (seq !== check.seq) return; // the text changed meanwhile: a newer check is on its way
    check.pending = false;
    if (res.ok) {
      if (!$("allow-type-change").checked) $("type-change").hidden = true;
      setValidation("ok", `Valid: saving makes version ${res.data.version}.`);
    } else if (res.status === 422 && res.data.type_changes) {
      // A key changing JSON type (lr 0.01 -> "0.0.1") is refused unless the box says it is meant.
      check.blocked = true;
      $("type-change").hidden = false;
      setValidation("error", `Refused: ${res.data.error}`);
    } else if (res.status === 422) {
      check.blocked = true;
      check.violations = res.data.violations || [];
      setValidation("error", "The job's schema refuses this config: fix the keys marked below.");
    } else if (res.status === 401 || res.status === 403) {
      setValidation("info", "Checked here only: the schema check needs this job's token (Save asks for it).");
    } else if (res.status === 409 && res.data.pending) {
      // A pending change would override this edit (or apply early with it): saving would be refused too.
      check.blocked = true;
      setValidation("error", `Refused: ${res.data.error}`);
    } else if (res.status === 409 || res.status === 0) {
      setValidation("info", `Not checked: ${res.data.error}`);
    } else {
      check.blocked = true;
      setValidation("error", `The lighthouse refuses this config: ${res.data.error}`);
    }
    renderViolations();
    updateSave();
  }

  function pointerOf(key) {
    return "/" + key.replaceAll("~", "~0").replaceAll("/", "~1");
  }

  // Violations as a list, and every key of the edit beside its schema description and problems.
  function renderViolations() {
    $("violations").replaceChildren(
      ...check.violations.map((v) =>
        el("li", { dataset: { path: v.path } }, el("code", {}, v.path || "/"), " ", v.message),
      ),
    );
    const properties = (schema && typeof schema === "object" && schema.properties) || {};
    const keys = [...new Set([...Object.keys(edited || (loaded && loaded.config) || {}), ...check.violations
      .filter((v) => v.path.split("/").length === 2)
      .map((v) => v.path.slice(1).replaceAll("~1", "/").replaceAll("~0", "~"))])];
    $("keys").replaceChildren(
      ...keys.map((key) => {
        const prop = properties[key];
        const description = prop && typeof prop.description === "string" ? prop.description : "";
        const problems = check.violations.filter((v) => v.path === pointerOf(key) || v.path.startsWith(pointerOf(key) + "/"));
        return el(
          "tr",
          { class: problems.length ? "violates" : "", dataset: { key } },
          el("td", { class: "key" }, key),
          el("td", { class: "description muted" }, description),
          el("td", { class: "problem" }, problems.map((v) => v.message).join("; ")),
        );
      }),
    );
  }

  function updateSave() {
    const rows = edited && loaded ? diff(loaded.config, edited) : null;
    $("save").disabled = !rows || rows.length === 0 || Boolean(stepValue().error) || check.pending || check.blocked;
  }

  function renderDiff(rows) {
    const list = $("diff");
    const nothing = rows !== null && rows.length === 0;
    updateSave();
    if (rows === null) {
      list.replaceChildren(el("p", { class: "muted" }, "Fix the JSON to see what would change."));
      return;
    }
    if (nothing) {
      list.replaceChildren(el("p", { class: "muted" }, `No changes to version ${loaded.version}.`));
      return;
    }
    list.replaceChildren(diffTable(rows));
  }

  // Per key what a change does (the editor's pending edit, or a version in the history); text only.
  function diffTable(rows) {
    const sign = { added: "+", removed: "−", changed: "~" };
    return el(
      "table",
      { class: "diff-table" },
      el(
        "tbody",
        {},
        rows.map((r) =>
          el(
            "tr",
            { class: `diff-${r.kind}`, dataset: { key: r.key, kind: r.kind } },
            el("td", { class: "sign" }, sign[r.kind]),
            el("td", { class: "key" }, r.key),
            el(
              "td",
              { class: "value" },
              r.kind === "added" ? stringify(r.after) : stringify(r.before),
              r.kind === "changed" ? el("span", { class: "arrow" }, " → ") : null,
              r.kind === "changed" ? el("span", { class: "new" }, stringify(r.after)) : null,
            ),
          ),
        ),
      ),
    );
  }

  async function load() {
    const described = await api("GET", "/api/config/schema");
    schema = described.ok ? described.data.schema : null;
    const res = await api("GET", "/api/config");
    // The latest version and its config, every pending change applied (a change made a moment ago
    // takes effect a few steps ahead, above the groups' step leases; one scheduled at its step):
    // editing the live config instead would undo them.
    const view = res.data;
    const patchNow = (view.scheduled || []).some((s) => s.scheduled && s.status === "pending");
    loaded = { version: view.version, config: view.config, patchNow };
    liveVersion = loaded.version;
    $("editor").value = stringify(loaded.config, "  ");
    $("loaded-version").textContent = `v${loaded.version}`;
    const ahead = view.from_step !== null && view.from_step !== undefined;
    $("upcoming").hidden = !ahead;
    $("upcoming").textContent = ahead
      ? `Editing version ${view.version} as of step ${view.from_step}, where its pending changes have taken effect in every group (the job is at step ${view.current_step}; groups get version ${view.live_version} now).` +
        (patchNow ? " A change scheduled ahead is pending: Save sends only the keys you change." : "")
      : "";
    const horizon = res.data.lease_horizon;
    $("at-step").placeholder = horizon >= 0 ? `now, or ≥ ${horizon + 1}` : "now";
    $("stale").hidden = true;
    onInput();
    await loadHistory();
  }

  async function save() {
    const step = stepValue();
    if (!edited || step.error) return;
    const base = loaded.version;
    $("save").disabled = true;
    setStatus($("status"), "info", "Saving…");
    const req = request(false);
    const res = await api(req.method, req.path, req.body, { "If-Match": String(base) });
    if (res.ok) {
      const at = res.data.effective_step;
      const when = at !== null && at !== undefined ? ` It takes effect at step ${at} in every group.` : " It is in effect now.";
      await load();
      $("comment").value = "";
      $("at-step").value = "";
      $("allow-type-change").checked = false;
      $("type-change").hidden = true;
      setStatus($("status"), "ok", `Saved as version ${res.data.version}.${when}`);
    } else if (res.status === 409 && res.data.pending) {
      // A pending change would override the edit, or apply early with it: the lighthouse says which.
      setStatus($("status"), "error", `Not saved: ${res.data.error}`);
      onInput();
    } else if (res.status === 409) {
      setStatus(
        $("status"),
        "error",
        `Not saved: the config was changed by someone else since you loaded version ${base} (live is now version ${res.data.version}). Reload, then re-apply your edit.`,
      );
      showStale(res.data.version);
      onInput();
    } else {
      if (res.data.type_changes) $("type-change").hidden = false;
      setStatus($("status"), "error", `Not saved: ${res.data.error}`);
      onInput();
    }
  }

  function showStale(version) {
    liveVersion = version;
    $("stale-text").textContent = `Version ${version} is live now; you are editing version ${loaded.version}.`;
    $("stale").hidden = false;
  }

  const SUMMARY_KEYS = 3; // keys a history row names before "+N more"
  const SUMMARY_CHARS = 40; // of each value there

  // What a version changed: its config against the version before it (null when that one is not
  // known: pruned, or on a page not loaded), per key.
  function versionChanges(item, previous) {
    const before = previous ? previous.config : item.version === 1 ? {} : null;
    return before === null ? null : diff(before, item.config);
  }

  function summaryRow(r) {
    const value = (v) => LHSvg.short(stringify(v), SUMMARY_CHARS);
    if (r.kind === "added") return el("span", { class: "d d-added", dataset: { key: r.key } }, `+ ${r.key}: ${value(r.after)}`);
    if (r.kind === "removed") return el("span", { class: "d d-removed", dataset: { key: r.key } }, `− ${r.key}`);
    return el("span", { class: "d d-changed", dataset: { key: r.key } }, `${r.key}: ${value(r.before)} → ${value(r.after)}`);
  }

  // The history's Change cell: "lr: 0.001 → 0.0005  + warmup: 100  − old_key  +3 more", expanded
  // to every key's old and new value.
  function changeCell(item, previous) {
    const change = item.change || {};
    if (item.op === "cancel") return el("span", {}, `cancel v${change.version}`);
    const rows = versionChanges(item, previous);
    if (rows === null) {
      const text = item.op === "put" ? `replace (${Object.keys(change).length} keys)` : patchText(change);
      return el("details", {}, el("summary", {}, text), el("pre", { class: "config-json" }, stringify(item.config, "  ")));
    }
    if (rows.length === 0) return el("span", { class: "muted" }, "no key changed");
    const more = rows.length - SUMMARY_KEYS;
    return el(
      "details",
      {},
      el("summary", {}, el("span", { class: "history-diff" }, rows.slice(0, SUMMARY_KEYS).map(summaryRow), more > 0 ? el("span", { class: "more" }, `+${more} more`) : null)),
      diffTable(rows),
    );
  }

  function patchText(change) {
    return Object.keys(change).map((k) => (change[k] === null ? `delete ${k}` : `${k} = ${stringify(change[k])}`)).join(", ");
  }

  async function rollback(version) {
    const res = await api("POST", "/api/config/rollback", { version });
    if (res.ok) {
      await load();
      setStatus($("status"), "ok", `Rolled back: version ${res.data.version} has the content of version ${version}.`);
    } else {
      setStatus($("status"), "error", `Rollback failed: ${res.data.error}`);
    }
  }

  // A history answer stops at the lighthouse's byte budget and names the next page (next_before):
  // the newest page is polled; older pages are fetched when asked for ("Show older versions") and
  // kept while the newest page still ends where they begin.
  let shownHistory = null;
  let older = { from: null, versions: [], next: null };
  async function loadHistory() {
    const res = await api("GET", "/api/config/history?limit=50");
    const newest = res.data.versions;
    const last = newest.length ? newest[newest.length - 1].version : 0;
    if (older.from !== last) older = { from: null, versions: [], next: null };
    const versions = [...newest, ...older.versions];
    const next = older.from === null ? res.data.next_before : older.next;
    // Where each run began: a row right above the version it began after (newest first).
    const runs = (res.data.runs || []).filter((r) => r.number > 0);
    const cut = res.data.retention || {};
    const key = stringify([versions.map((v) => [v.version, v.cancelled]), next ?? null, runs.map((r) => [r.number, r.live]), cut]);
    if (key === shownHistory) return;
    shownHistory = key;
    const head = versions.length ? versions[0].version : 0;
    const more = next === undefined || next === null ? [] : [
      el("tr", { class: "history-more" }, el("td", { colspan: 8 },
        el("button", { type: "button", class: "small", "data-testid": "history-older", onclick: () => loadOlder(next) }, "Show older versions"))),
    ];
    // Where the history was cut (the lighthouse's retention): under its oldest version, once shown.
    const folded = cut.fold_step >= 0 ? `; steps up to ${cut.fold_step} resolve as step ${cut.fold_step} (${cut.keep_steps} steps kept)` : "";
    const cutRows = more.length || !cut.pruned_through ? [] : [
      el("tr", { class: "history-cut", "data-testid": "history-cut" }, el("td", { colspan: 8 },
        `Versions up to v${cut.pruned_through} were pruned` + (cut.history_limit ? ` (history limit ${cut.history_limit})` : "") + `${folded}.`)),
    ];
    const runRow = (r) => el("tr", { class: "history-run", dataset: { run: r.number }, "data-testid": "history-run" },
      el("td", { colspan: 8 }, el("span", { class: "pill" }, `run ${r.number}`),
        ` began at step ${r.start_step} after v${r.base_version}` + (r.run_id ? ` (run id ${r.run_id})` : "") +
        (r.live ? " · live" : ` · ended at step ${r.end_step} (${r.end_reason})`)));
    $("history").replaceChildren(
      ...versions.flatMap((v, i) => [
        ...runs.filter((r) => r.base_version === v.version).reverse().map(runRow),
        el(
          "tr",
          { dataset: { version: v.version } },
          el("td", { class: "num" }, `v${v.version}`, v.version === head ? el("span", { class: "pill ok" }, "latest") : null),
          el("td", { class: "mono" }, fmtTime(v.created_at)),
          el("td", { class: "value" }, changeCell(v, versions[i + 1])),
          el(
            "td",
            {},
            v.effective_step !== null ? `step ${v.effective_step}` : "now",
            v.cancelled ? el("span", { class: "pill muted" }, "cancelled") : null,
          ),
          el("td", {}, v.source),
          el("td", {}, v.author),
          el("td", { class: "comment" }, v.comment),
          el(
            "td",
            {},
            v.version === head || v.op === "cancel"
              ? null
              : confirmButton("Rollback", "Confirm rollback", { class: "small", "data-testid": `rollback-${v.version}` }, () => rollback(v.version)),
          ),
        ),
      ]),
      ...more,
      ...cutRows,
    );
  }

  async function loadOlder(before) {
    const res = await api("GET", `/api/config/history?limit=50&before=${before}`);
    if (!res.ok) return;
    const from = older.from === null ? before : older.from;
    const kept = older.versions.filter((v) => v.version > before);
    older = { from, versions: [...kept, ...res.data.versions], next: res.data.next_before };
    await loadHistory();
  }

  async function poll() {
    try {
      const res = await api("GET", "/healthz");
      if (loaded && res.data.version !== liveVersion) {
        const untouched = edited && diff(loaded.config, edited).length === 0;
        if (untouched) await load(); // nothing of yours to lose: follow the live version
        else if (res.data.version !== loaded.version) showStale(res.data.version);
        await loadHistory();
      }
      $("conn").className = "conn ok";
      $("conn").textContent = "live";
    } catch {
      $("conn").className = "conn error";
      $("conn").textContent = "lighthouse unreachable";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", async () => {
    $("editor").addEventListener("input", onInput);
    $("at-step").addEventListener("input", onInput);
    $("allow-type-change").addEventListener("change", onInput);
    $("save").addEventListener("click", save);
    $("reload").addEventListener("click", async () => {
      await load();
      setStatus($("status"), "info", `Loaded version ${loaded.version}.`);
    });
    $("stale-reload").addEventListener("click", async () => {
      await load();
      setStatus($("status"), "info", `Loaded version ${loaded.version}; your unsaved edits were discarded.`);
    });
    $("format").addEventListener("click", () => {
      if (edited) $("editor").value = stringify(edited, "  ");
    });
    try {
      await load();
      $("conn").className = "conn ok";
      $("conn").textContent = "live";
    } catch {
      setStatus($("status"), "error", "Cannot reach the lighthouse.");
    }
    setTimeout(poll, POLL_MS);
  });
})();
