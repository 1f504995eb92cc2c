// The cluster view: one row per job (version, last change, managers, step, schedule, file error),
// each linking to its dashboard and editor; refreshed every 2 s.
"use strict";

(() => {
  const { api, el, fmtAgo, fmtTime } = LH;
  const REFRESH_MS = 2000;
  const $ = (id) => document.getElementById(id);

  function row(job) {
    const base = `/jobs/${encodeURIComponent(job.job)}`;
    const by = job.author && job.author !== "-" ? job.author : null;
    const change = job.updated_at
      ? el("td", { class: "changed", title: fmtTime(job.updated_at) }, fmtAgo(job.updated_at),
          el("span", { class: "sub" }, [by ? `by ${by}` : null, job.source ? `via ${job.source}` : null].filter(Boolean).join(" ")))
      : el("td", { class: "changed muted" }, "never");
    const managers = job.managers
      ? el("td", { class: "managers" },
          el("span", {}, `${job.managers_live} of ${job.managers} live`),
          el("span", { class: "sub" },
            job.managers_behind ? el("span", { class: "pill warn" }, `${job.managers_behind} behind`) : el("span", { class: "pill ok" }, "all current"),
            job.late_groups ? el("span", { class: "pill warn" }, `${job.late_groups} late`) : null))
      : el("td", { class: "managers muted" }, "none yet");
    return el("tr", { dataset: { job: job.job } },
      el("td", { class: "job" },
        el("a", { href: base, "data-testid": "job-link" }, job.job),
        job.file_error ? el("span", { class: "pill error", title: job.file_error }, "file error") : null,
        job.file_error ? el("span", { class: "sub file-error" }, job.file_error) : null,
        job.stalled ? el("span", { class: "pill error", title: job.stall_reason, "data-testid": "stalled" }, "stalled") : null,
        job.stalled ? el("span", { class: "sub stall-reason" }, job.stall_reason) : null),
      el("td", { class: "version" }, job.version ? `v${job.version}` : "–"),
      change,
      managers,
      el("td", { class: "num step" }, job.current_step >= 0 ? job.current_step.toLocaleString("en-US") : "–"),
      el("td", { class: "scheduled" }, job.scheduled ? el("span", { class: "pill muted" }, `${job.scheduled} pending`) : el("span", { class: "muted" }, "–")),
      el("td", { class: "links" },
        el("a", { href: base, class: "link-button" }, "Dashboard"),
        el("a", { href: `${base}/config`, class: "link-button", "data-testid": "editor-link" }, "Editor")),
    );
  }

  function renderSummary(jobs) {
    const sum = (f) => jobs.reduce((n, j) => n + (j[f] || 0), 0);
    const errors = jobs.filter((j) => j.file_error).length;
    $("job-count").textContent = String(jobs.length);
    $("job-errors").textContent = errors ? `${errors} with a config file error` : "no file errors";
    $("live-count").textContent = String(sum("managers_live"));
    $("live-detail").textContent = `of ${sum("managers")} managers, reported in the last minute`;
    $("behind-count").textContent = String(sum("managers_behind"));
    const late = sum("late_groups");
    $("late-detail").textContent = `on an older version · ${late} group${late === 1 ? "" : "s"} switched late`;
    $("scheduled-count").textContent = String(sum("scheduled"));
  }

  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    const conn = $("conn");
    try {
      const res = await api("GET", "/api/jobs");
      const jobs = res.data.jobs;
      renderSummary(jobs);
      $("jobs-body").replaceChildren(...jobs.map(row));
      $("jobs-empty").hidden = jobs.length > 0;
      conn.textContent = "live";
      conn.className = "conn ok";
    } catch {
      conn.textContent = "lighthouse unreachable";
      conn.className = "conn error";
    } finally {
      timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", refresh);
})();
