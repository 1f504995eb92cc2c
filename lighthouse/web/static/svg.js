// Building inline SVG pictures with DOM calls only (text nodes for every value, so nothing in a
// config, an author or a metric name can run), shared by the timeline and the metric charts.
"use strict";

const LHSvg = (() => {
  const NS = "http://www.w3.org/2000/svg";

  // svg("line", {x1: 0, ...}, child, "text", ...): attributes set when not null/undefined/false.
  function svg(tag, attrs = {}, ...children) {
    const node = document.createElementNS(NS, tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value !== undefined && value !== null && value !== false) node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // A hover text (SVG's own tooltip).
  const title = (text) => svg("title", {}, text);

  // Round numbers from `min` to `max`: 1, 2, 5 x 10^k apart, about `count` of them.
  function ticks(min, max, count) {
    const span = max - min;
    if (!(span > 0)) return [min];
    const raw = span / count;
    const mag = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    const out = [];
    for (let t = Math.ceil(min / step) * step; t <= max + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
    return out;
  }

  function short(text, n) {
    const s = String(text ?? "");
    return s.length > n ? s.slice(0, n - 1) + "…" : s;
  }

  return { svg, title, ticks, short };
})();
