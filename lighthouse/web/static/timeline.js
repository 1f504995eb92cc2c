// The job timeline as an inline SVG picture: job step on the x axis, one row per version with the
// steps it held (from /api/config/timeline), a "now" line, scheduled changes ahead and late groups.
// Built with DOM calls only (text nodes for every value), so nothing in a config or an id can run.
"use strict";

const LHTimeline = (() => {
  const { svg, title, ticks, short } = LHSvg;
  const LABEL_W = 170; // left column: version and author
  const PAD_R = 24;
  const TOP = 34; // room for the "now" and scheduled labels
  const ROW_H = 24;
  const BAR_H = 14;
  const AXIS_H = 40;
  const MAX_LATE_ROWS = 8;

  // The job's runs (GET /api/config/timeline's `runs`), but the implicit run 0 of a job stored
  // before runs existed.
  function runsOf(data) {
    return (data.runs || []).filter((r) => r.number > 0);
  }

  function describe(data) {
    const segs = data.segments;
    // The server's live version names what is served at the job's step (the card says the same).
    const lastHeld = segs.filter((s) => !s.pending).at(-1);
    const liveVersion = data.live_version ?? (lastHeld || {}).version;
    const live = segs.filter((s) => s.version === liveVersion).at(-1) || lastHeld;
    const pending = segs.filter((s) => s.pending);
    const parts = [];
    parts.push(data.current_step >= 0 ? `The job is at step ${data.current_step}.` : "No manager has reported a step yet.");
    if (live) parts.push(`Version ${live.version} is live, from step ${live.from_step}.`);
    for (const s of pending) parts.push(`Version ${s.version} is scheduled for step ${s.from_step}.`);
    if (data.late_groups.length) {
      parts.push(`${data.late_groups.length} group switch${data.late_groups.length === 1 ? "" : "es"} came late: ` +
        data.late_groups.map((g) => `${g.replica_id} to version ${g.version} at step ${g.switched_at_step} (${g.late_by_steps} late)`).join(", ") + ".");
    }
    for (const r of runsOf(data)) {
      parts.push(`Run ${r.number} began at step ${r.start_step} after version ${r.base_version}` +
        (r.live ? " and is live." : `, ended at step ${r.end_step} (${r.end_reason}).`));
    }
    if (data.earlier) parts.push(`${data.earlier} earlier versions are not shown.`);
    return parts.join(" ");
  }

  // Draws `data` (GET /api/config/timeline) into `container`, replacing what was there.
  function render(container, data, jobName) {
    const segs = data.segments;
    const width = Math.max(container.clientWidth || 900, 480);
    const plotW = width - LABEL_W - PAD_R;
    const lateShown = data.late_groups.slice(0, MAX_LATE_ROWS);
    const lateHidden = data.late_groups.length - lateShown.length;
    const rowCount = Math.max(segs.length, 1) + lateShown.length + (lateHidden ? 1 : 0);
    const height = TOP + rowCount * ROW_H + AXIS_H;
    const now = Math.max(data.current_step, 0);
    const furthest = Math.max(
      now,
      ...segs.map((s) => s.from_step),
      ...data.late_groups.map((g) => g.switched_at_step),
    );
    const end = Math.max(10, Math.ceil(furthest * 1.2 + 1));
    const x = (step) => LABEL_W + (Math.min(step, end) / end) * plotW;
    const rowY = (i) => TOP + i * ROW_H;
    // The server's live version: the one the dashboard's card names and whose config it shows.
    const liveVersion = data.live_version ?? (segs.filter((s) => !s.pending).at(-1) || {}).version;

    const root = svg("svg", {
      class: "timeline",
      role: "img",
      width: "100%",
      viewBox: `0 0 ${width} ${height}`,
      "aria-labelledby": "timeline-title timeline-desc",
      "data-testid": "timeline-svg",
    });
    root.append(
      svg("title", { id: "timeline-title" }, `Timeline of job ${jobName}: versions by job step`),
      svg("desc", { id: "timeline-desc" }, describe(data)),
    );

    // Grid and axis.
    const axisY = TOP + rowCount * ROW_H + 6;
    const axis = svg("g", { class: "tl-axis" });
    for (const t of ticks(0, end, Math.max(2, Math.floor(plotW / 110)))) {
      axis.append(
        svg("line", { class: "tl-grid", x1: x(t), x2: x(t), y1: TOP - 4, y2: axisY }),
        svg("text", { x: x(t), y: axisY + 16, "text-anchor": "middle" }, t.toLocaleString("en-US")),
      );
    }
    axis.append(
      svg("line", { class: "tl-axis-line", x1: LABEL_W, x2: LABEL_W + plotW, y1: axisY, y2: axisY }),
      svg("text", { class: "tl-axis-title", x: LABEL_W - 10, y: axisY + 16, "text-anchor": "end" }, "job step →"),
    );
    root.append(axis);

    // One row per version: the steps it held (or will hold, dashed, when scheduled ahead).
    const rows = svg("g", { class: "tl-rows" });
    segs.forEach((s, i) => {
      const y = rowY(i);
      const x0 = x(s.from_step);
      const x1 = s.to_step === null ? LABEL_W + plotW : x(s.to_step);
      const kind = s.pending ? "tl-pending" : s.version === liveVersion ? "tl-live" : "tl-past";
      const held = s.to_step === null ? `from step ${s.from_step} on` : s.to_step === s.from_step
        ? `superseded at step ${s.from_step} before any step ran with it`
        : `steps ${s.from_step} to ${s.to_step - 1}`;
      const when = s.pending ? `scheduled for step ${s.from_step}` : held;
      const tip = `v${s.version}: ${when}\n${LH.fmtTime(s.created_at)} by ${s.author || "-"} via ${s.source}` +
        (s.comment ? `\n${s.comment}` : "");
      const row = svg("g", { class: `tl-seg ${kind}`, "data-version": s.version, "data-from": s.from_step });
      if (i % 2 === 0) row.append(svg("rect", { class: "tl-band", x: 0, y, width, height: ROW_H }));
      row.append(
        svg("text", { class: "tl-label", x: 10, y: y + ROW_H / 2 + 4 }, `v${s.version}`,
          svg("tspan", { class: "tl-author", dx: 8 }, short(s.author && s.author !== "-" ? s.author : s.source, 16))),
        svg("rect", {
          class: "tl-bar", x: x0, y: y + (ROW_H - BAR_H) / 2, width: Math.max(x1 - x0, 3), height: BAR_H, rx: 3,
        }, title(tip)),
      );
      if (s.pending) {
        const inside = x1 - x0 > 140;
        row.append(svg("text", {
          class: "tl-bar-label", x: inside ? x0 + 6 : x0 - 6, y: y + ROW_H / 2 + 4, "text-anchor": inside ? "start" : "end",
        }, `scheduled · step ${s.from_step}`));
      } else if (s.to_step === s.from_step) {
        row.append(svg("text", { class: "tl-bar-label tl-superseded", x: x0 + 8, y: y + ROW_H / 2 + 4 }, `superseded at step ${s.from_step}`));
      } else if (s.version === liveVersion && x1 - x0 > 60) {
        row.append(svg("text", { class: "tl-bar-label on-bar", x: x0 + 6, y: y + ROW_H / 2 + 4 }, "live"));
      }
      rows.append(row);
    });
    if (!segs.length) {
      rows.append(svg("text", { class: "tl-empty", x: LABEL_W + 8, y: TOP + ROW_H / 2 + 4 }, "No version stored yet."));
    }
    root.append(rows);

    // Late groups, one row each under the versions: from the step the change was due to the step
    // the group switched to it.
    const late = svg("g", { class: "tl-late-groups" });
    lateShown.forEach((g, k) => {
      const y = rowY(Math.max(segs.length, 1) + k);
      const cy = y + ROW_H / 2;
      const cx = x(g.switched_at_step);
      const tip = `${g.replica_id} switched to v${g.version} at step ${g.switched_at_step}, ` +
        `${g.late_by_steps} step${g.late_by_steps === 1 ? "" : "s"} after step ${g.effective_step}`;
      late.append(
        svg("g", { class: "tl-late", "data-replica": g.replica_id, "data-version": g.version },
          svg("text", { class: "tl-late-label", x: 10, y: cy + 4 }, short(g.replica_id, 14),
            svg("tspan", { class: "tl-author", dx: 6 }, `→ v${g.version}`)),
          svg("line", { class: "tl-late-span", x1: x(g.effective_step), x2: cx, y1: cy, y2: cy }),
          svg("path", { class: "tl-late-mark", d: `M${cx} ${cy - 7} L${cx + 6} ${cy + 5} L${cx - 6} ${cy + 5} Z` }, title(tip)),
          svg("text", { class: "tl-late-label", x: cx + 10, y: cy + 4 }, `+${g.late_by_steps} steps`),
        ),
      );
    });
    if (lateHidden) {
      late.append(svg("text", { class: "tl-late-label", x: 10, y: rowY(Math.max(segs.length, 1) + lateShown.length) + ROW_H / 2 + 4 },
        `+${lateHidden} more late switches (see the table below)`));
    }
    root.append(late);

    // Scheduled changes ahead: a dashed line and a diamond on the axis at their step.
    const ahead = svg("g", { class: "tl-markers" });
    for (const s of segs.filter((seg) => seg.pending)) {
      const mx = x(s.from_step);
      ahead.append(
        svg("g", { class: "tl-scheduled", "data-version": s.version, "data-step": s.from_step },
          svg("line", { x1: mx, x2: mx, y1: TOP - 4, y2: axisY }),
          svg("path", { d: `M${mx} ${axisY - 6} L${mx + 6} ${axisY} L${mx} ${axisY + 6} L${mx - 6} ${axisY} Z` },
            title(`v${s.version} scheduled for step ${s.from_step}`)),
          svg("text", { x: mx, y: TOP - 10, "text-anchor": "middle" }, `v${s.version} @ ${s.from_step}`),
        ),
      );
    }
    root.append(ahead);

    // Runs: where each began and at which step (a job resumed from a checkpoint starts lower).
    const runMarks = svg("g", { class: "tl-runs" });
    for (const r of runsOf(data)) {
      const rx = x(r.start_step);
      const tip = `run ${r.number} began at step ${r.start_step} after v${r.base_version}` +
        (r.run_id ? ` (run id ${r.run_id})` : "") +
        (r.live ? ", live" : `; ended at step ${r.end_step} (${r.end_reason})`);
      runMarks.append(
        svg("g", { class: "tl-run", "data-run": r.number, "data-step": r.start_step, "data-testid": "timeline-run" },
          svg("line", { x1: rx, x2: rx, y1: TOP - 4, y2: axisY }, title(tip)),
          svg("text", { x: rx + 3, y: axisY - 4 }, `run ${r.number} @ ${r.start_step}`),
        ),
      );
    }
    root.append(runMarks);

    if (data.earlier) {
      root.append(svg("text", { class: "tl-earlier", x: 10, y: 12 }, `${data.earlier} earlier version${data.earlier === 1 ? "" : "s"} not shown`));
    }

    // Now: the job's current step.
    const nx = x(now);
    const nowLabel = data.current_step >= 0 ? `now · step ${data.current_step}` : "now · no step reported";
    root.append(
      svg("g", { class: "tl-now", "data-step": data.current_step },
        svg("line", { x1: nx, x2: nx, y1: TOP - 4, y2: axisY }),
        svg("text", { x: nx, y: 12, "text-anchor": nx > width - 90 ? "end" : nx < LABEL_W + 40 ? "start" : "middle" }, nowLabel),
      ),
    );

    container.replaceChildren(root);
  }

  return { render };
})();
