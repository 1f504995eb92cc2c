// Shared by the dashboard and the editor: API calls with the admin token, a lossless JSON
// parser, and a DOM builder that only ever sets text (never HTML), so config values cannot run.
"use strict";

const LH = (() => {
  // The token last entered in this tab (the admin token works for every job), and per job the one
  // that job accepted, so a job editor moving between jobs is asked once per job.
  const TOKEN_KEY = "lighthouse-admin-token";
  // The name a change from these pages records as its author (X-Author), kept across visits.
  const AUTHOR_KEY = "lighthouse-author";
  // On /jobs/{job} and /jobs/{job}/config the pages act on that job; elsewhere on the job "default".
  const JOB = (() => {
    const m = location.pathname.match(/^\/jobs\/([^/]+)/);
    return m ? decodeURIComponent(m[1]) : null;
  })();

  // The per-job API routes of the page's job: /api/config... -> /api/jobs/{job}/config...
  function jobPath(path) {
    const perJob = ["/api/config", "/api/managers", "/api/metrics"].some((p) => path.startsWith(p));
    if (JOB === null || !perJob) return path;
    return `/api/jobs/${encodeURIComponent(JOB)}${path.slice(4)}`;
  }

  // The page links of the page's job, its name in the header and a link back to the jobs list.
  function jobLinks() {
    if (JOB === null) {
      showDefaultJob();
      return;
    }
    const base = `/jobs/${encodeURIComponent(JOB)}`;
    for (const a of document.querySelectorAll('a[href="/"]:not([data-nav="jobs"]), a[href="/config"]')) {
      a.setAttribute("href", a.getAttribute("href") === "/" ? base : `${base}/config`);
    }
    for (const a of document.querySelectorAll('a[data-nav="jobs"]')) a.hidden = false;
    const jobName = document.getElementById("job-name");
    if (jobName) {
      jobName.textContent = JOB;
      jobName.closest(".job-badge").hidden = false;
    }
    document.title = `${JOB} · ${document.title}`;
  }

  // The unprefixed pages act on the job "default": say so once the lighthouse serves other jobs too.
  async function showDefaultJob() {
    const jobName = document.getElementById("job-name");
    if (!jobName) return;
    try {
      const res = await fetch("/api/jobs", { cache: "no-store" });
      const jobs = (await res.json()).jobs || [];
      if (!jobs.some((j) => j.job !== "default")) return;
    } catch {
      return;
    }
    jobName.textContent = "default";
    jobName.closest(".job-badge").hidden = false;
    for (const a of document.querySelectorAll('a[data-nav="jobs"]')) a.hidden = false;
  }

  // A number whose JSON text a JS number cannot reproduce (1.0, 1e-05, 2**64): kept as written,
  // so an edit in the browser never changes the value workers receive for keys it did not touch.
  class RawNumber {
    constructor(raw) { this.raw = raw; }
    toString() { return this.raw; }
    valueOf() { return Number(this.raw); } // arithmetic and comparisons see the number
  }

  // Containers one config may nest (the lighthouse's MAX_JSON_DEPTH, put on the page by it); an
  // API answer holds a config at most ANSWER_DEPTH levels down (history: versions[i].changes[key].before).
  const MAX_JSON_DEPTH = Number(document.documentElement.dataset.maxJsonDepth);
  const ANSWER_DEPTH = 8;

  function parseJson(text, maxDepth = MAX_JSON_DEPTH) {
    let i = 0;
    const n = text.length;
    const fail = (msg, at = i) => {
      const before = text.slice(0, at);
      const line = before.split("\n").length;
      const col = at - before.lastIndexOf("\n");
      throw new SyntaxError(`${msg} at line ${line} column ${col}`);
    };
    const ws = () => { while (i < n && " \t\n\r".includes(text[i])) i++; };
    const numberRe = /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/y;

    function value(depth) {
      ws();
      if (i >= n) fail("unexpected end of input");
      const c = text[i];
      if (c === "{") return object(depth);
      if (c === "[") return array(depth);
      if (c === '"') return string();
      if (c === "-" || (c >= "0" && c <= "9")) return number();
      for (const [word, v] of [["true", true], ["false", false], ["null", null]]) {
        if (text.startsWith(word, i)) { i += word.length; return v; }
      }
      fail(`unexpected character ${JSON.stringify(c)}`);
    }
    // A container opened below `depth` others is nested depth + 1 levels deep.
    const open = (depth) => {
      if (!(depth < maxDepth)) fail(`nested too deeply (max ${maxDepth} levels)`);
      i++;
    };
    function object(depth) {
      open(depth);
      const obj = Object.create(null);
      ws();
      if (text[i] === "}") { i++; return obj; }
      for (;;) {
        ws();
        if (text[i] !== '"') fail("expected a \"key\"");
        const at = i;
        const key = string();
        if (Object.hasOwn(obj, key)) fail(`duplicate key ${JSON.stringify(key)}`, at);
        ws();
        if (text[i] !== ":") fail("expected ':'");
        i++;
        obj[key] = value(depth + 1);
        ws();
        if (text[i] === ",") { i++; continue; }
        if (text[i] === "}") { i++; return obj; }
        fail("expected ',' or '}'");
      }
    }
    function array(depth) {
      open(depth);
      const out = [];
      ws();
      if (text[i] === "]") { i++; return out; }
      for (;;) {
        out.push(value(depth + 1));
        ws();
        if (text[i] === ",") { i++; continue; }
        if (text[i] === "]") { i++; return out; }
        fail("expected ',' or ']'");
      }
    }
    function string() {
      const start = i++;
      while (i < n) {
        const c = text[i];
        if (c === '"') {
          i++;
          try { return JSON.parse(text.slice(start, i)); } catch { fail("invalid escape in string", start); }
        }
        if (c === "\\") { i += 2; continue; }
        if (c < " ") fail("control character in string");
        i++;
      }
      fail("unterminated string", start);
    }
    function number() {
      numberRe.lastIndex = i;
      const m = numberRe.exec(text);
      if (!m) fail("invalid number");
      i = numberRe.lastIndex;
      const num = Number(m[0]);
      return String(num) === m[0] ? num : new RawNumber(m[0]);
    }

    const result = value(0);
    ws();
    if (i < n) fail("unexpected text after the JSON value");
    return result;
  }

  function stringify(v, indent = "", level = 0) {
    if (v === null) return "null";
    if (v instanceof RawNumber) return v.raw;
    if (typeof v !== "object") return JSON.stringify(v);
    const pad = indent ? "\n" + indent.repeat(level + 1) : "";
    const end = indent ? "\n" + indent.repeat(level) : "";
    if (Array.isArray(v)) {
      if (!v.length) return "[]";
      return "[" + v.map((x) => pad + stringify(x, indent, level + 1)).join(",") + end + "]";
    }
    const keys = Object.keys(v);
    if (!keys.length) return "{}";
    const sep = indent ? ": " : ":";
    return "{" + keys.map((k) => pad + JSON.stringify(k) + sep + stringify(v[k], indent, level + 1)).join(",") + end + "}";
  }

  // el("td", {class: "x", dataset: {v: 1}}, "text", childNode): text children become text nodes.
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "dataset") Object.assign(node.dataset, value);
      else if (name === "onclick") node.addEventListener("click", value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // ---- admin token: asked for once when the API answers 401, kept for this tab only
  const jobTokenKey = () => `${TOKEN_KEY}:${JOB === null ? "default" : JOB}`;
  let tokenWaiter = null;

  // The banner in the user's words, not HTTP's (the API's own text names headers and statuses).
  function tokenReason(sent, otherJob) {
    if (otherJob) return "That token is for another job: paste this job's token (or the admin token) here.";
    if (sent) return "That token was not accepted: paste the right one here.";
    return "Changes need a token: paste it here.";
  }

  function askToken(reason) {
    if (tokenWaiter) return tokenWaiter.promise;
    const bar = document.getElementById("token-bar");
    const input = document.getElementById("token");
    const message = document.getElementById("token-reason");
    message.textContent = reason || "Changes need a token: paste it here.";
    bar.hidden = false;
    input.value = "";
    input.focus();
    let resolve;
    const promise = new Promise((r) => { resolve = r; });
    tokenWaiter = { promise, resolve };
    return promise;
  }

  function initTokenBar() {
    const bar = document.getElementById("token-bar");
    if (!bar) return;
    const finish = (token) => {
      bar.hidden = true;
      if (token) {
        sessionStorage.setItem(TOKEN_KEY, token);
        sessionStorage.setItem(jobTokenKey(), token);
      }
      const waiter = tokenWaiter;
      tokenWaiter = null;
      if (waiter) waiter.resolve(token);
    };
    bar.addEventListener("submit", (ev) => {
      ev.preventDefault();
      finish(document.getElementById("token").value.trim() || null);
    });
    document.getElementById("token-cancel").addEventListener("click", () => finish(null));
  }

  // Returns {ok, status, data}; throws only when the lighthouse cannot be reached.
  // ask=false: a 401 is returned as it is instead of asking for the token (background checks).
  async function api(method, path, body, headers = {}, ask = true) {
    const token = sessionStorage.getItem(jobTokenKey()) || sessionStorage.getItem(TOKEN_KEY);
    const sent = { ...headers };
    if (token) sent.Authorization = "Bearer " + token;
    const author = method === "GET" || !ask ? "" : authorName(); // background checks record nothing
    if (author) sent["X-Author"] = headerText(author);
    const init = { method, headers: sent, cache: "no-store" };
    if (body !== undefined) {
      sent["Content-Type"] = "application/json";
      init.body = typeof body === "string" ? body : JSON.stringify(body);
    }
    const res = await fetch(jobPath(path), init);
    const text = await res.text();
    let data;
    try {
      data = parseJson(text, MAX_JSON_DEPTH + ANSWER_DEPTH);
    } catch {
      data = { error: `${res.status} ${res.statusText}` };
    }
    // 401: no or a wrong token; 403 naming another job: a job token of another job (ask for this one's).
    const otherJob = res.status === 403 && token && /^this token edits job/.test((data && data.error) || "");
    if ((res.status === 401 || otherJob) && method !== "GET" && ask) {
      if (sessionStorage.getItem(TOKEN_KEY) === token) sessionStorage.removeItem(TOKEN_KEY);
      sessionStorage.removeItem(jobTokenKey());
      if (await askToken(tokenReason(token, otherJob))) return api(method, path, body, headers);
    }
    if (author && res.status === 400 && /^X-Author /.test((data && data.error) || "")) {
      authorRefused(data.error);
    } else if (author && res.ok) {
      keepAuthor(author);
    }
    return { ok: res.ok, status: res.status, data };
  }

  // ---- the author: asked for in a bar under the header while none is kept (a name typed there
  // is used by the next change, and kept once the lighthouse accepts it); "author: alice ✎" changes it.
  const authorBar = () => document.getElementById("author-bar");

  function authorName() {
    const kept = localStorage.getItem(AUTHOR_KEY);
    if (kept) return kept;
    const bar = authorBar();
    return bar && !bar.hidden ? document.getElementById("author-name").value.trim() : "";
  }

  // Header values are bytes: the name goes as UTF-8 (the lighthouse decodes it so).
  const headerText = (name) => String.fromCharCode(...new TextEncoder().encode(name));

  function keepAuthor(name) {
    localStorage.setItem(AUTHOR_KEY, name);
    const bar = authorBar();
    if (bar) bar.hidden = true;
    showAuthor();
  }

  function authorRefused(message) {
    localStorage.removeItem(AUTHOR_KEY);
    showAuthor();
    openAuthorBar(message);
  }

  function showAuthor() {
    const button = document.getElementById("author-edit");
    if (button) button.textContent = `author: ${localStorage.getItem(AUTHOR_KEY) || "not set"} ✎`;
  }

  function openAuthorBar(refusal = "") {
    const bar = authorBar();
    if (!bar) return;
    const reason = document.getElementById("author-reason");
    reason.textContent = refusal ? `Not accepted: ${refusal}` : "";
    reason.hidden = !refusal;
    const input = document.getElementById("author-name");
    input.value = localStorage.getItem(AUTHOR_KEY) || "";
    bar.hidden = false;
    input.focus();
  }

  function initAuthorBar() {
    const bar = authorBar();
    if (!bar) return;
    showAuthor();
    bar.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const name = document.getElementById("author-name").value.trim();
      if (name) keepAuthor(name);
      else bar.hidden = true;
    });
    document.getElementById("author-later").addEventListener("click", () => { bar.hidden = true; });
    document.getElementById("author-edit").addEventListener("click", () => openAuthorBar());
    if (!localStorage.getItem(AUTHOR_KEY) && document.querySelector('header.topbar[data-page="editor"]')) openAuthorBar();
  }

  function fmtTime(epochSeconds) {
    if (epochSeconds === null || epochSeconds === undefined) return "–";
    const d = new Date(Number(epochSeconds) * 1000);
    const pad = (x) => String(x).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function fmtAgo(epochSeconds) {
    const s = Math.max(0, Date.now() / 1000 - Number(epochSeconds));
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} d ago`;
  }

  // A button that asks "Confirm?" on the first click and acts on a second click within 4 s.
  function confirmButton(label, confirmLabel, attrs, action) {
    const button = el("button", { type: "button", ...attrs }, label);
    let armed = null;
    button.addEventListener("click", async () => {
      if (!armed) {
        button.textContent = confirmLabel;
        button.classList.add("armed");
        armed = setTimeout(() => { armed = null; button.textContent = label; button.classList.remove("armed"); }, 4000);
        return;
      }
      clearTimeout(armed);
      armed = null;
      button.disabled = true;
      try { await action(); } finally { button.disabled = false; button.textContent = label; button.classList.remove("armed"); }
    });
    return button;
  }

  function setStatus(node, kind, text) {
    node.className = "status " + kind;
    node.textContent = text;
  }

  // ---- the header and the token bar, written once here for every page: each page has only
  // <header class="topbar" data-page="dashboard|editor|jobs"></header>, filled in before its own
  // script runs (deferred scripts run in order, after the page is parsed).
  function renderChrome() {
    const header = document.querySelector("header.topbar[data-page]");
    if (!header) return;
    const page = header.dataset.page;
    const link = (label, href, current, attrs = {}) =>
      el("a", { href, class: current ? "active" : null, "aria-current": current ? "page" : null, ...attrs }, label);
    const brand = el("span", { class: "brand" }, "lighthouse", el("span", { class: "brand-dim" }, "-config"));
    const conn = el("span", { id: "conn", class: "conn" }, "connecting…");
    header.after(el("div", { id: "store-bar", class: "store-bar", role: "alert", "data-testid": "store-bar", hidden: true }));
    if (page === "jobs") {
      header.append(brand, el("nav", {}, link("Jobs", "/", true)), conn);
      return;
    }
    header.append(
      brand,
      el("span", { class: "job-badge", hidden: true }, "job", el("strong", { id: "job-name", "data-testid": "job-name" })),
      el("nav", {},
        link("All jobs", "/", false, { "data-nav": "jobs", hidden: true }),
        link("Dashboard", "/", page === "dashboard"),
        link("Config editor", "/config", page === "editor")),
      el("button", { type: "button", id: "author-edit", class: "small author-edit", "data-testid": "author-edit", title: "the name your changes record as their author" }, "author: not set ✎"),
      conn,
    );
    header.after(el("form", { id: "author-bar", class: "token-bar author-bar", "data-testid": "author-bar", hidden: true },
      el("span", { id: "author-reason", class: "refused", "data-testid": "author-reason", role: "alert", hidden: true }),
      el("label", {}, "Your name (recorded as the author) ",
        el("input", { id: "author-name", "data-testid": "author-name", autocomplete: "name", maxlength: 64, placeholder: "e.g. alice" })),
      el("button", { type: "submit", class: "primary small" }, "Use name"),
      el("button", { type: "button", id: "author-later", class: "small" }, "Later")));
    header.after(el("form", { id: "token-bar", class: "token-bar", hidden: true },
      el("span", { id: "token-reason" }),
      el("span", { id: "token-form-fields" },
        el("input", { id: "token", type: "password", autocomplete: "off", placeholder: "admin token", "aria-label": "admin token" }),
        el("button", { type: "submit", class: "primary small" }, "Use token"),
        el("button", { type: "button", id: "token-cancel", class: "small" }, "Cancel"))));
  }

  // ---- a store that cannot take edits (a full disk): a banner on every page, gone once space is back
  const STORE_POLL_MS = 5000;
  async function watchStore() {
    const bar = document.getElementById("store-bar");
    try {
      const res = await fetch("/healthz", { cache: "no-store" });
      const health = await res.json();
      const full = health.store === "full";
      bar.hidden = !full;
      bar.textContent = full
        ? `Edits are refused: ${health.store_problem}. Workers keep their config; edits work again once space is free.`
        : "";
    } catch {
      // unreachable: the header says so
    } finally {
      setTimeout(watchStore, STORE_POLL_MS);
    }
  }

  renderChrome();
  document.addEventListener("DOMContentLoaded", watchStore);
  document.addEventListener("DOMContentLoaded", initTokenBar);
  document.addEventListener("DOMContentLoaded", initAuthorBar);
  document.addEventListener("DOMContentLoaded", jobLinks);

  return { JOB, RawNumber, parseJson, stringify, el, api, fmtTime, fmtAgo, confirmButton, setStatus };
})();
