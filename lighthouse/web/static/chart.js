// Training metrics against config changes: one inline SVG chart per reported metric (job step on
// the x axis), where an operator sees what a change did.
//
// Each chart draws the mean across groups (a line) between the min and the max (a band), a marker
// at every version's step (hover: who changed what; dashed: scheduled ahead; red: a guard's
// rollback), the job's current step, non-finite values (red triangles on top), guarded changes
// (the steps they watch, shaded by status, and the threshold they hold the metric to), and on
// demand one line per replica group (recent steps). Data: /api/metrics, /api/config/timeline and
// /api/config/guards, refreshed every REFRESH_MS.
"use strict";

const LHChart = (() => {
  const { svg, title, ticks, short } = LHSvg;
  const REFRESH_MS = 2000;
  const HEIGHT = 210;
  const PAD = { left: 68, right: 18, top: 26, bottom: 30 };
  const TIMELINE_LIMIT = 200;
  const GROUP_COLORS = ["#d9480f", "#2b8a3e", "#862e9c", "#1971c2", "#e67700", "#0b7285", "#c2255c", "#5f3dc4"];
  const LEGEND_MAX = 12; // groups named under a chart; the rest as "N more" (hover lists them)

  const fmt = (v) => (v === null || v === undefined ? "–" : Number(v).toPrecision(4).replace(/\.?0+(e|$)/, "$1"));
  const lastStep = (p) => (p.to_step ?? p.step);

  // What a version did, in one line: "lr = 0.02, bs = 64" or "replaced the config (12 keys)".
  function changeText(seg) {
    const change = seg.change || {};
    const keys = Object.keys(change);
    if (seg.op === "put") return `replaced the config (${keys.length} key${keys.length === 1 ? "" : "s"})`;
    return keys.map((k) => (change[k] === null ? `deleted ${k}` : `${k} = ${LH.stringify(change[k])}`)).join(", ");
  }

  function versionTip(seg) {
    const who = seg.author && seg.author !== "-" ? `${seg.author} via ${seg.source}` : `via ${seg.source}`;
    const when = seg.pending ? `scheduled for step ${seg.from_step}` : `from step ${seg.from_step}`;
    return `v${seg.version} ${when}, ${who}\n${short(changeText(seg), 300)}` + (seg.comment ? `\n${short(seg.comment, 300)}` : "");
  }

  function guardTip(g) {
    const threshold = g.baseline === null ? "its mean before the change" : `${g.factor} × ${fmt(g.baseline)}`;
    const outcome = g.status === "triggered" || g.status === "lapsed"
      ? `${g.status}: ${g.reason}` + (g.rollback_version ? ` (rolled back as v${g.rollback_version})` : "")
      : g.status;
    return `guard of v${g.version}: ${g.metric} (mean of ${g.window} steps) at most ${threshold}, ` +
      `finite, in steps ${g.effective_step} to ${g.until_step}: ${outcome}`;
  }

  // A path through the points that have `y(p)`; a point without one breaks the line.
  function linePath(points, x, y) {
    let d = "";
    let pen = false;
    for (const p of points) {
      const v = y(p);
      if (v === null) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x(p.step).toFixed(1)} ${v.toFixed(1)}`;
      pen = true;
    }
    return d;
  }

  // The min-max band: one closed shape per run of points that have both.
  function bandPath(points, x, y) {
    const runs = [[]];
    for (const p of points) {
      if (p.min === null || p.max === null) { if (runs.at(-1).length) runs.push([]); continue; }
      runs.at(-1).push(p);
    }
    return runs.filter((r) => r.length).map((run) => {
      const top = run.map((p, i) => `${i ? "L" : "M"}${x(p.step).toFixed(1)} ${y(p.max).toFixed(1)}`).join("");
      const bottom = [...run].reverse().map((p) => `L${x(p.step).toFixed(1)} ${y(p.min).toFixed(1)}`).join("");
      return top + bottom + "Z";
    }).join("");
  }

  // The steps every chart shares: from the first reported step to the newest step, the job's step
  // or the furthest scheduled change, whichever is last.
  function stepRange(data) {
    const all = Object.values(data.metrics.metrics).flat();
    const pending = data.timeline.segments.filter((s) => s.pending).map((s) => s.from_step);
    const first = all.length ? Math.min(...all.map((p) => p.step)) : 0;
    const last = Math.max(first + 10, data.timeline.current_step, ...all.map(lastStep), ...pending);
    return [first, last + Math.ceil((last - first) * 0.02)];
  }

  function renderOne(name, points, groups, data, range, width) {
    const [s0, s1] = range;
    const left = PAD.left;
    const right = width - PAD.right;
    const top = PAD.top;
    const bottom = HEIGHT - PAD.bottom;
    const x = (step) => left + ((Math.min(Math.max(step, s0), s1) - s0) / (s1 - s0)) * (right - left);
    const guards = data.guards.filter((g) => g.metric === name);
    const thresholds = guards.filter((g) => g.baseline !== null).map((g) => g.factor * g.baseline);
    const values = points.map((p) => p.mean).filter((v) => v !== null);
    for (const rows of Object.values(groups)) values.push(...rows.map((p) => p.mean).filter((v) => v !== null));
    let lo = Math.min(...values, ...thresholds);
    let hi = Math.max(...values, ...thresholds);
    if (!Number.isFinite(lo)) { lo = 0; hi = 1; }
    if (hi === lo) { hi += Math.abs(hi) * 0.1 || 1; lo -= Math.abs(lo) * 0.1 || 1; }
    const pad = (hi - lo) * 0.08;
    lo -= pad;
    hi += pad;
    const y = (v) => bottom - ((Math.min(Math.max(v, lo), hi) - lo) / (hi - lo)) * (bottom - top);
    const last = points.filter((p) => p.mean !== null).at(-1);

    const root = svg("svg", {
      class: "chart", role: "img", width: "100%", viewBox: `0 0 ${width} ${HEIGHT}`,
      "data-metric": name, "data-step-from": s0, "data-step-to": s1, "data-plot-left": left, "data-plot-right": right,
      "aria-label": `${name} by job step` + (last ? `; ${fmt(last.mean)} at step ${lastStep(last)}` : ""),
    });
    root.append(svg("text", { class: "ch-title", x: left, y: 16 }, name,
      svg("tspan", { class: "ch-sub", dx: 10 }, last ? `mean ${fmt(last.mean)} at step ${lastStep(last)}` : "no finite value yet")));

    // Axes and grid.
    const axis = svg("g", { class: "ch-axis" });
    for (const t of ticks(lo, hi, 4)) {
      axis.append(
        svg("line", { class: "ch-grid", x1: left, x2: right, y1: y(t), y2: y(t) }),
        svg("text", { x: left - 8, y: y(t) + 4, "text-anchor": "end" }, fmt(t)),
      );
    }
    for (const t of ticks(s0, s1, Math.max(2, Math.floor((right - left) / 110)))) {
      axis.append(
        svg("line", { class: "ch-grid", x1: x(t), x2: x(t), y1: top, y2: bottom }),
        svg("text", { x: x(t), y: bottom + 17, "text-anchor": "middle" }, t.toLocaleString("en-US")),
      );
    }
    axis.append(svg("line", { class: "ch-axis-line", x1: left, x2: right, y1: bottom, y2: bottom }));
    root.append(axis);

    // Guarded steps behind everything, with the threshold the metric was held to.
    const guardLayer = svg("g", { class: "ch-guards" });
    for (const g of guards) {
      const gx0 = x(g.effective_step);
      const gx1 = x(g.until_step);
      const node = svg("g", { class: `ch-guard ch-guard-${g.status}`, "data-version": g.version, "data-status": g.status },
        svg("rect", { x: gx0, y: top, width: Math.max(gx1 - gx0, 2), height: bottom - top }, title(guardTip(g))));
      if (g.baseline !== null) {
        const ty = y(g.factor * g.baseline);
        node.append(svg("line", { class: "ch-threshold", x1: gx0, x2: gx1, y1: ty, y2: ty }));
      }
      guardLayer.append(node);
    }
    root.append(guardLayer);

    // The data: band, per-group lines on demand, mean line.
    root.append(svg("path", { class: "ch-band", d: bandPath(points, x, y) }));
    Object.keys(groups).sort().forEach((replica, i) => {
      root.append(svg("path", {
        class: "ch-group", "data-replica": replica, stroke: groupColor(i),
        d: linePath(groups[replica], x, (p) => (p.mean === null ? null : y(p.mean))),
      }, title(`group ${replica}`)));
    });
    root.append(svg("path", { class: "ch-mean", d: linePath(points, x, (p) => (p.mean === null ? null : y(p.mean))) },
      title(`${name}: mean across groups`)));

    // Non-finite values, on top of the plot.
    const bad = svg("g", { class: "ch-nonfinite-marks" });
    for (const p of points.filter((q) => q.nonfinite > 0)) {
      const cx = x(p.step);
      const span = p.to_step === undefined ? `step ${p.step}` : `steps ${p.step} to ${p.to_step}`;
      bad.append(svg("path", {
        class: "ch-nonfinite", "data-step": p.step, d: `M${cx - 5} ${top} L${cx + 5} ${top} L${cx} ${top + 8} Z`,
      }, title(`${span}: ${p.nonfinite} of ${p.count} values not finite (NaN or inf)`)));
    }
    root.append(bad);

    // The job's step now, and one marker per version at its step.
    if (data.timeline.current_step >= 0) {
      const nx = x(data.timeline.current_step);
      root.append(svg("line", { class: "ch-now", x1: nx, x2: nx, y1: top, y2: bottom },
        title(`now: the job is at step ${data.timeline.current_step}`)));
    }
    const markers = svg("g", { class: "ch-versions" });
    for (const seg of data.timeline.segments) {
      const mx = x(seg.from_step);
      const kind = seg.pending ? " ch-scheduled" : seg.author === "guard" ? " ch-rollback" : "";
      markers.append(svg("g", { class: `ch-version${kind}`, "data-version": seg.version, "data-step": seg.from_step },
        svg("line", { x1: mx, x2: mx, y1: top - 4, y2: bottom }),
        svg("text", { x: mx + 3, y: top + 2 }, `v${seg.version}`),
        svg("rect", { class: "ch-hover", x: mx - 4, y: top - 4, width: 8, height: bottom - top + 4 }, title(versionTip(seg))),
      ));
    }
    root.append(markers);
    return Object.keys(groups).length ? [root, groupLegend(name, Object.keys(groups).sort())] : [root];
  }

  const groupColor = (i) => GROUP_COLORS[i % GROUP_COLORS.length];

  // Which line is which replica group: the first LEGEND_MAX by name, then how many more.
  function groupLegend(name, replicas) {
    const shown = replicas.slice(0, LEGEND_MAX);
    const rest = replicas.slice(LEGEND_MAX);
    return LH.el("ul", { class: "chart-legend", "data-metric": name, "data-testid": "chart-legend" },
      shown.map((replica, i) => LH.el("li", { dataset: { replica } },
        svg("svg", { class: "swatch", width: 16, height: 8, "aria-hidden": "true" },
          svg("line", { x1: 0, x2: 16, y1: 4, y2: 4, stroke: groupColor(i), "stroke-width": 2.5 })),
        replica)),
      rest.length ? LH.el("li", { class: "more", title: rest.join(", ") }, `${rest.length} more`) : null);
  }

  // One line per guard under the charts: what it watches and how it ended.
  function renderGuards(guards) {
    const pill = { active: "warn", passed: "ok", triggered: "error", lapsed: "", cancelled: "" };
    document.getElementById("guards-list").replaceChildren(...guards.map((g) =>
      LH.el("li", { dataset: { version: g.version, status: g.status } },
        LH.el("span", { class: `pill ${pill[g.status] ?? ""}` }, g.status), " ", guardTip(g))));
  }

  let shown = null;
  let latest = null;

  function render(force = false) {
    if (!latest) return;
    const key = LH.stringify(latest);
    if (key === shown && !force) return; // keep the pictures (and an open tooltip) as they are
    shown = key;
    const box = document.getElementById("charts");
    const names = Object.keys(latest.metrics.metrics);
    document.getElementById("charts-empty").hidden = names.length > 0;
    const width = Math.max(box.clientWidth || 900, 480);
    const range = stepRange(latest);
    const perGroup = latest.metrics.groups || {};
    // Up to the newest step every group has reported (later ones may still miss a group's values).
    const settled = (name) => {
      const last = latest.metrics.last[name];
      return latest.metrics.metrics[name].filter((p) => !last || p.step <= last.step);
    };
    box.replaceChildren(...names.flatMap((name) => renderOne(name, settled(name), perGroup[name] || {}, latest, range, width)));
    renderGuards(latest.guards);
    const dropped = latest.metrics.dropped;
    document.getElementById("charts-dropped").textContent = dropped
      ? `${dropped} reported value${dropped === 1 ? " was" : "s were"} dropped on the way (full buffers, failed calls).` : "";
  }

  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const box = document.getElementById("charts");
      const points = Math.max(100, Math.floor((box.clientWidth || 900) / 2));
      const groups = document.getElementById("chart-groups").checked ? "&groups=1" : "";
      const [metrics, timeline, guards] = await Promise.all([
        LH.api("GET", `/api/metrics?max_points=${points}${groups}`),
        LH.api("GET", `/api/config/timeline?limit=${TIMELINE_LIMIT}`),
        LH.api("GET", "/api/config/guards"),
      ]);
      if (metrics.ok && timeline.ok && guards.ok) {
        latest = { metrics: metrics.data, timeline: timeline.data, guards: guards.data.guards };
        render();
      }
    } catch {
      // The dashboard's own refresh says when the lighthouse is unreachable.
    } finally {
      timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    if (!document.getElementById("charts")) return;
    document.getElementById("chart-groups").addEventListener("change", refresh);
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => render(true), 200);
    });
    refresh();
  });

  return { render };
})();
