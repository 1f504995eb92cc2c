// The cluster view: one row per job, each linking to its dashboard and editor.
"use strict";

(() => {
  const { api, el, fmtAgo } = LH;

  async function refresh() {
    const conn = document.getElementById("conn");
    let res;
    try {
      res = await api("GET", "/api/jobs");
    } catch {
      conn.textContent = "lighthouse unreachable";
      conn.className = "conn bad";
      return;
    }
    conn.textContent = "live";
    conn.className = "conn ok";
    const body = document.getElementById("jobs-body");
    body.replaceChildren(
      ...res.data.jobs.map((job) => {
        const base = `/jobs/${encodeURIComponent(job.job)}`;
        const managers = `${job.managers_live} live · ${job.managers_behind} behind · ${job.late_groups} late`;
        const change = job.updated_at ? `${fmtAgo(job.updated_at)} by ${job.author || "-"}` : "–";
        return el("tr", { "data-job": job.job }, [
          el("td", {}, [el("a", { href: base }, job.job)]),
          el("td", {}, String(job.version)),
          el("td", {}, change),
          el("td", {}, managers),
          el("td", {}, job.current_step < 0 ? "–" : String(job.current_step)),
          el("td", {}, String(job.scheduled)),
          el("td", {}, [el("a", { href: `${base}/config` }, "editor")]),
        ]);
      }),
    );
  }

  document.addEventListener("DOMContentLoaded", () => {
    refresh();
    setInterval(refresh, 2000);
  });
})();
