// The dashboard: live config, timeline, pending changes (scheduled, or made now and taking effect above the
// groups' step leases) and the managers with their leases, refreshed every 1.5 s.
"use strict";

(() => {
  const { el, api, stringify, fmtTime, fmtAgo, confirmButton, setStatus } = LH;
  const REFRESH_MS = 1500;
  const LATE_AFTER_S = 3;
  const TIMELINE_ROWS = 20;
  const $ = (id) => document.getElementById(id);

  function renderConfig(view) {
    // The version served at the job's step (whose config is shown below); a pending one apart.
    $("version").textContent = `v${view.live_version ?? view.version}`;
    const pending = view.pending;
    $("pending-version").hidden = !pending;
    $("pending-version").textContent = pending ? `v${pending.version} pending, from step ${pending.effective_step}` : "";
    $("updated").textContent = view.updated_at ? `${fmtTime(view.updated_at)} (${fmtAgo(view.updated_at)})` : "never";
    const by = view.author && view.author !== "-" ? `${view.author} via ${view.source}` : view.source;
    $("changed-by").textContent = by || "–";
    $("changed-comment").textContent = view.comment || "";
    $("step").textContent = view.current_step >= 0 ? String(view.current_step) : "–";
    const suspendedBy = view.step_leases_suspended_by || [];
    $("step-detail").textContent = suspendedBy.length
      ? `step leases suspended: ${suspendedBy.join(", ")} on the store does not honour them (an earlier release); changes apply at once`
      : view.lease_horizon >= 0
        ? `promised through step ${view.lease_horizon}: a change made now takes effect after it`
        : "highest step any manager reported";
    const error = view.file && view.file.error;
    $("file-error").hidden = !error;
    $("file-error-text").textContent = error || "";
    // The live config: what groups get at the job's step (config is the latest version's, pending changes applied).
    const live = view.live ?? view.config;
    const keys = Object.keys(live);
    $("config-count").textContent = `${keys.length} key${keys.length === 1 ? "" : "s"}`;
    $("config").replaceChildren(
      ...keys.map((k) => el("tr", {}, el("td", { class: "key" }, k), el("td", { class: "value" }, stringify(live[k])))),
    );
    $("config-empty").hidden = keys.length > 0;
  }

  function renderStall(job) {
    $("stalled").hidden = !job.stalled;
    $("stalled").textContent = job.stalled ? `stalled: ${job.stall_reason}` : "";
  }

  function renderManagers(managers, current) {
    $("manager-count").textContent = String(managers.length);
    const upToDate = managers.filter((m) => m.version >= current).length;
    $("manager-uptodate").textContent = managers.length ? `${upToDate} of ${managers.length} hold v${current}` : "none yet";
    $("managers-empty").hidden = managers.length > 0;
    $("managers").replaceChildren(
      ...managers.map((m) => {
        const late = m.last_seen_s > LATE_AFTER_S;
        const behind = m.version < current;
        const ratio = m.requests > 0 ? `${((100 * m.cache_hits) / m.requests).toFixed(1)} %` : "–";
        return el(
          "tr",
          { dataset: { replica: m.replica_id }, class: late ? "row-late" : null },
          el("td", { class: "key" }, m.replica_id),
          el("td", { class: "mono" }, m.address, m.lighthouse ? el("span", { class: "sub" }, `via ${m.lighthouse}`) : null),
          el(
            "td",
            { class: "identity", title: m.identity ? "the credential its calls presented" : "an open lighthouse: no credential asked" },
            m.identity || "–",
          ),
          el("td", { class: "last-seen" }, `${Number(m.last_seen_s).toFixed(1)} s`, late ? el("span", { class: "pill warn" }, "late") : null),
          el(
            "td",
            // What its workers get at its step; a change it holds for a later step is named apart.
            { class: "served-version", dataset: { version: m.live_version ?? m.version, held: m.version } },
            `v${m.live_version ?? m.version}`,
            behind
              ? el("span", { class: "pill warn" }, m.behind_versions > 1 ? `${m.behind_versions} behind` : "behind")
              : el("span", { class: "pill ok" }, "current"),
            m.pending_version != null
              ? el("span", { class: "sub pending-version" }, `v${m.pending_version} pending from step ${m.pending_step}`)
              : null,
          ),
          el(
            "td",
            { class: "mode", title: m.mode === "push" ? "the lighthouse pushes each new version down its stream" : "asks every cache TTL" },
            m.mode || "poll",
          ),
          el("td", { class: "num" }, m.step >= 0 ? m.step : "–"),
          el(
            "td",
            { class: "num lease" },
            m.lease_through_step >= 0 ? m.lease_through_step : "–",
            m.past_lease ? el("span", { class: "pill warn", title: "served steps past its step lease: the fallback, not a confirmed config" }, "past lease") : null,
          ),
          el("td", { class: "num" }, m.requests),
          el("td", { class: "num" }, ratio),
        );
      }),
    );
  }

  function changeSummary(item) {
    const change = item.change || {};
    if (item.op === "put") return `replace with ${Object.keys(change).length} keys`;
    return Object.keys(change).map((k) => (change[k] === null ? `delete ${k}` : `${k} = ${stringify(change[k])}`)).join(", ");
  }

  let shownScheduled = null;
  function renderScheduled(items, horizon) {
    const pending = items.filter((s) => s.status === "pending");
    const late = items.filter((s) => s.status === "in_effect" && s.late_groups.length);
    const promised = (s) => s.effective_step <= horizon; // the groups were promised its step: final
    const key = stringify([pending.map((s) => [s.version, promised(s)]), late.map((s) => s.late_groups)]);
    if (key === shownScheduled) return; // keep rows (and a half-confirmed Cancel) as they are
    shownScheduled = key;
    $("scheduled-empty").hidden = pending.length > 0;
    $("scheduled").replaceChildren(
      ...pending.map((s) =>
        el(
          "tr",
          { dataset: { version: s.version } },
          el("td", {}, `v${s.version}`, el("span", { class: "sub" }, s.scheduled ? "scheduled" : "made now")),
          el("td", { class: "num" }, s.effective_step),
          el("td", { class: "value" }, changeSummary(s)),
          el("td", {}, s.author),
          el("td", {}, s.comment),
          el(
            "td",
            {},
            promised(s)
              ? el("span", { class: "pill muted", title: "every group was promised this step: it will take effect" }, "promised")
              : confirmButton("Cancel", "Confirm cancel", { class: "danger small", "data-testid": `cancel-${s.version}` }, () => cancel(s.version)),
          ),
        ),
      ),
    );
    $("late-section").hidden = late.length === 0;
    $("late").replaceChildren(
      ...late.flatMap((s) =>
        s.late_groups.map((g) =>
          el(
            "tr",
            {},
            el("td", {}, `v${s.version}`),
            el("td", { class: "num" }, s.effective_step),
            el("td", { class: "key" }, g.replica_id),
            el("td", { class: "num" }, g.switched_at_step),
            el("td", { class: "num" }, `+${g.late_by_steps}`),
          ),
        ),
      ),
    );
  }

  async function cancel(version) {
    const res = await api("DELETE", `/api/config/scheduled/${encodeURIComponent(version)}`);
    if (res.ok) setStatus($("status"), "ok", `Cancelled the change scheduled as v${version} (new version v${res.data.version}).`);
    else setStatus($("status"), "error", `Not cancelled: ${res.data.error}`);
    refresh();
  }

  // torchft's view (lighthouse serve --torchft): its latest quorum, read from the replies forwarded.
  let torchftOn = true; // until the lighthouse says it runs no torchft lighthouse
  function renderTorchft(view) {
    $("torchft-panel").hidden = !view;
    if (!view) {
      torchftOn = false;
      return;
    }
    $("torchft-page").textContent = view.page;
    const q = view.quorum;
    $("torchft-table").hidden = !q;
    if (q) {
      const n = q.members.length;
      $("torchft-quorum").textContent =
        `quorum ${q.id} at step ${q.step}: ${n} replica group${n === 1 ? "" : "s"} (handed out ${Number(q.seconds_ago).toFixed(1)} s ago)`;
      $("torchft-members").replaceChildren(
        ...q.members.map((m) =>
          el(
            "tr",
            { dataset: { replica: m.replica_id } },
            el("td", { class: "key" }, m.replica_id),
            el("td", { class: "num" }, m.step),
            el("td", { class: "num" }, m.world_size),
            el("td", { class: "mono" }, m.address),
            el("td", {}, m.heartbeat_s === null ? "–" : `${Number(m.heartbeat_s).toFixed(1)} s ago`),
          ),
        ),
      );
    }
    const beats = view.heartbeats;
    $("torchft-heartbeats").textContent = beats.length
      ? `heartbeating: ${beats.map((b) => `${b.replica_id} (${Number(b.seconds_ago).toFixed(1)} s ago)`).join(", ")}`
      : "no replica group heartbeating";
  }

  let shownTimeline = null;
  let lastTimeline = null;
  function renderTimeline(data, force = false) {
    const key = stringify(data);
    if (key === shownTimeline && !force) return; // keep the picture (and an open tooltip) as it is
    shownTimeline = key;
    lastTimeline = data;
    LHTimeline.render($("timeline"), data, LH.JOB || "default");
  }

  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const [view, managers, scheduled, timeline, job, torchft] = await Promise.all([
        api("GET", "/api/config"),
        api("GET", "/api/managers"),
        api("GET", "/api/config/scheduled"),
        api("GET", `/api/config/timeline?limit=${TIMELINE_ROWS}`),
        api("GET", `/api/jobs/${encodeURIComponent(LH.JOB || "default")}`),
        torchftOn ? api("GET", "/api/torchft") : null,
      ]);
      if (torchft) renderTorchft(torchft.data.torchft);
      renderConfig(view.data);
      renderStall(job.data);
      renderManagers(managers.data.managers, view.data.version);
      renderScheduled(scheduled.data.scheduled, view.data.lease_horizon);
      renderTimeline(timeline.data);
      $("conn").className = "conn ok";
      $("conn").textContent = "live";
    } catch (err) {
      console.error("dashboard refresh failed:", err);
      $("conn").className = "conn error";
      $("conn").textContent = "lighthouse unreachable";
    } finally {
      timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", refresh);
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (lastTimeline) renderTimeline(lastTimeline, true); }, 200);
  });
})();
