/* specvit's interactive diagram: specvitView(element, data) draws the data of
 * specvit.diagram.viewdata.view_data (with the SVG layouts of specvit.diagram.html.layouts) into element.
 *
 * The pictures are Graphviz's SVG; behaviour is attached by node name (each SVG node's <title>). Every string
 * of the data came from a spec and is written as text (textContent), never as markup; the SVG is parsed as
 * XML and stripped of scripts, event handlers and outside links before it is shown. Nothing is fetched.
 *
 * Returns {reveal(path), select(path), toggle(run), expanded(), update(data)}; update redraws with new data
 * (a live editor's), keeping the expanded runs, the selection and the zoom where they still exist.
 */
"use strict";

function specvitView(root, data, kept) {
  // the zoom at which the drawing fills the canvas's width: Graphviz gives the width in pt, a pt is 4/3 px
  const fitWidth = (svg) => (canvas.clientWidth - 16) / ((svg.dataset.width * 4) / 3);
  const SVGNS = "http://www.w3.org/2000/svg";
  const nodes = data.nodes;
  const groups = data.groups;
  const runOfBlock = new Map();
  for (const g of groups) for (const b of g.blocks) runOfBlock.set(b, g.id);
  const groupById = new Map(groups.map((g) => [g.id, g]));
  const cache = new Map();
  const state = {
    expanded: new Set(((kept && kept.expanded) || []).filter((id) => groupById.has(id))),
    selected: kept && kept.selected in nodes ? kept.selected : null,
    zoom: kept ? kept.zoom : null,
    boxes: new Map(),
    svg: null,
  };
  if (!kept && data.initial) for (const id of data.initial.split("\n")) state.expanded.add(id);

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const count = (n) => Number(n).toLocaleString("en-US");
  const keyOf = (set) => groups.filter((g) => set.has(g.id)).map((g) => g.id).join("\n");
  // new data (update) may lack the layout of the runs kept expanded (a live editor sends the folded one
  // first): show it folded then
  if (!(keyOf(state.expanded) in data.layouts)) state.expanded = new Set();

  // -- the page's parts ----------------------------------------------------------------------------
  root.replaceChildren();
  root.classList.add("sv-root");
  const header = el("header", "sv-header");
  header.append(el("h1", "sv-title", data.title));
  if (data.description) header.append(el("p", "sv-description", data.description));
  header.append(el("p", "sv-subtitle", data.subtitle));
  const bar = el("div", "sv-toolbar");
  const find = el("div", "sv-find");
  const search = el("input", "sv-search");
  search.type = "search";
  search.placeholder = "find a node by path";
  search.setAttribute("aria-label", "find a node by path");
  const results = el("ul", "sv-results");
  find.append(search, results);
  const runsBar = el("div", "sv-runs");
  const zoomBar = el("div", "sv-zoom");
  bar.append(find, runsBar, zoomBar);
  const main = el("div", "sv-main");
  const canvas = el("div", "sv-canvas");
  const details = el("aside", "sv-details");
  main.append(canvas, details);
  const tip = el("div", "sv-tip");
  tip.hidden = true;
  root.append(header, bar, main, tip);

  // -- SVG -----------------------------------------------------------------------------------------
  const DROP = new Set(["script", "foreignobject", "iframe", "object", "embed", "style", "image", "use"]);
  function clean(svg) {
    for (const e of [svg, ...svg.querySelectorAll("*")]) {
      if (DROP.has(e.localName.toLowerCase())) {
        e.remove();
        continue;
      }
      for (const a of [...e.attributes]) {
        const name = a.name.toLowerCase();
        const link = name === "href" || name.endsWith(":href");
        if (name.startsWith("on") || (link && !a.value.startsWith("#")) || name.endsWith(":title")) {
          e.removeAttribute(a.name);
        }
      }
    }
    return svg;
  }
  function picture(key) {
    if (!cache.has(key)) {
      const doc = new DOMParser().parseFromString(data.layouts[key], "image/svg+xml");
      const svg = doc.documentElement;
      if (svg.localName !== "svg" || svg.namespaceURI !== SVGNS) throw new Error("specvit: a layout is not SVG");
      const shown = clean(document.importNode(svg, true));
      shown.dataset.width = parseFloat(shown.getAttribute("width"));
      shown.dataset.height = parseFloat(shown.getAttribute("height"));
      cache.set(key, shown);
    }
    return cache.get(key);
  }
  function nameOf(g) {
    // the Graphviz name, kept before mark() rewrites a folded block's title into its tooltip
    if (g.dataset.name === undefined) {
      const t = g.querySelector(":scope > title");
      g.dataset.name = t ? t.textContent : "";
    }
    return g.dataset.name;
  }

  function show() {
    const svg = picture(keyOf(state.expanded));
    state.svg = svg;
    state.boxes = new Map();
    for (const g of svg.querySelectorAll("g.node")) {
      const name = nameOf(g);
      if (name in nodes) {
        g.dataset.path = name;
        state.boxes.set(name, g);
      } else if (name.endsWith(" (caption)")) {
        mark(g, name.slice(0, -" (caption)".length), true);
      }
    }
    for (const g of svg.querySelectorAll("g.cluster")) mark(g, nameOf(g).replace(/^cluster_/, ""), false);
    canvas.replaceChildren(svg);
    if (state.zoom === null) state.zoom = Math.min(1, fitWidth(svg) || 1);
    zoom(state.zoom);
    highlight();
    drawRuns();
  }
  function mark(g, block, caption) {
    // a folded block toggles from its caption or its frame; an expanded one from its caption only (a click
    // on its frame is more likely a near miss of one of its boxes)
    const run = runOfBlock.get(block);
    const open = state.expanded.has(run);
    const t = g.querySelector(":scope > title");
    g.classList.remove("sv-folded", "sv-unfolded");
    delete g.dataset.run;
    if (t) t.textContent = g.dataset.name;
    if (run === undefined || (open && !caption)) return;
    const group = groupById.get(run);
    g.dataset.run = run;
    g.classList.add(open ? "sv-unfolded" : "sv-folded");
    if (t) t.textContent = `${group.label} x${group.count}: click to ${open ? "fold" : "expand"}`;
  }
  function zoom(z) {
    state.zoom = Math.max(0.05, Math.min(4, z));
    const svg = state.svg;
    svg.setAttribute("width", `${svg.dataset.width * state.zoom}pt`);
    svg.setAttribute("height", `${svg.dataset.height * state.zoom}pt`);
  }
  const zoomButton = (label, title, fn) => {
    const b = el("button", "sv-button", label);
    b.type = "button";
    b.title = title;
    b.addEventListener("click", fn);
    zoomBar.append(b);
  };
  zoomButton("−", "zoom out", () => zoom(state.zoom / 1.25));
  zoomButton("fit", "fit the width", () => zoom(fitWidth(state.svg)));
  zoomButton("100%", "actual size", () => zoom(1));
  zoomButton("+", "zoom in", () => zoom(state.zoom * 1.25));

  // -- folding -------------------------------------------------------------------------------------
  function setExpanded(next) {
    if (!(keyOf(next) in data.layouts)) return false;
    state.expanded = next;
    show();
    return true;
  }
  function toggle(run) {
    if (!groupById.has(run)) return false;
    const next = new Set(state.expanded);
    const adding = !next.has(run);
    if (adding) next.add(run);
    else next.delete(run);
    // a combination not laid out (more runs than specvit combines): the run alone, or all folded
    return setExpanded(next) || setExpanded(adding ? new Set([run]) : new Set());
  }
  function drawRuns() {
    runsBar.replaceChildren();
    for (const g of groups) {
      const open = state.expanded.has(g.id);
      const b = el("button", "sv-button sv-run", `${open ? "▾" : "▸"} ${g.label} ×${g.count}`);
      b.type = "button";
      b.dataset.run = g.id;
      b.setAttribute("aria-pressed", String(open));
      b.disabled = !g.expandable;
      b.title = g.expandable
        ? `${open ? "fold" : "expand"} the ${g.count} blocks of ${g.label}`
        : `${g.count} blocks, drawn folded (expanded: ${g.why}); the search finds each of their nodes`;
      b.addEventListener("click", () => toggle(g.id));
      runsBar.append(b);
    }
    if (groups.length > 1) {
      const all = new Set(groups.map((g) => g.id));
      const every = el("button", "sv-button", state.expanded.size ? "fold all" : "expand all");
      every.type = "button";
      every.disabled = !state.expanded.size && !(keyOf(all) in data.layouts);
      every.addEventListener("click", () => setExpanded(state.expanded.size ? new Set() : all));
      runsBar.append(every);
    }
  }

  // -- selection and details -----------------------------------------------------------------------
  function boxOf(path) {
    if (state.boxes.has(path)) return state.boxes.get(path);
    const box = nodes[path] && nodes[path].box;
    return box && state.boxes.has(box) ? state.boxes.get(box) : null;
  }
  function highlight() {
    for (const g of state.svg.querySelectorAll(".sv-selected, .sv-match")) g.classList.remove("sv-selected", "sv-match");
    for (const path of state.matches || []) {
      const g = boxOf(path);
      if (g) g.classList.add("sv-match");
    }
    const g = state.selected && boxOf(state.selected);
    if (g) g.classList.add("sv-selected");
  }
  function select(path) {
    if (!(path in nodes)) return false;
    state.selected = path;
    highlight();
    const g = boxOf(path);
    if (g) g.scrollIntoView({ block: "center", inline: "center" });
    describe(path);
    return true;
  }
  function reveal(path) {
    const n = nodes[path];
    if (!n) return false;
    if (n.run && !state.expanded.has(n.run) && !state.boxes.has(path)) toggle(n.run);
    return select(path);
  }
  function row(list, name, value, field) {
    list.append(el("dt", null, name));
    const dd = el("dd", null, value);
    if (field) dd.dataset.field = field;
    list.append(dd);
    return dd;
  }
  function describe(path) {
    const n = nodes[path];
    details.replaceChildren();
    const head = el("h2", "sv-path", n.path);
    head.dataset.field = "path";
    const kind = data.kinds[n.kind] || ["#fff", "#888", n.kind];
    const op = el("p", "sv-op");
    const swatch = el("span", "sv-swatch");
    swatch.style.background = kind[0];
    swatch.style.borderColor = kind[1];
    op.append(swatch, el("b", null, n.op), el("span", "sv-kind", ` ${kind[2]}`));
    details.append(head, op);
    if (n.run) {
      const g = groupById.get(n.run);
      const folded = !state.expanded.has(n.run) && n.box && n.box !== path ? `; drawn folded as ${n.box}` : "";
      details.append(el("p", "sv-note", `block ${g.blocks.indexOf(n.block) + 1} of ${g.count} in ${g.label}${folded}`));
    }
    for (const line of n.label) details.append(el("p", "sv-label", line));
    const dl = el("dl", "sv-facts");
    row(dl, "output", n.shape || "—", "shape");
    for (const [port, shape] of Object.entries(n.inputs)) row(dl, `input ${port}`, shape || "—", `input-${port}`);
    row(dl, "parameters", n.params ? `${count(n.params)} (${n.params_text})` : "none", "params");
    const exact = count(n.flops) + (n.useful_flops !== n.flops ? ` (useful ${count(n.useful_flops)})` : "");
    row(dl, data.unit.name, n.flops ? `${n.flops_text} · ${exact}` : "none", "flops");
    details.append(dl);
    if (n.source) {
      const s = n.source;
      details.append(el("h3", null, "spec"));
      const at = el("p", "sv-at", `${s.file}${s.line ? `:${s.line}` : ""}${s.col ? `:${s.col}` : ""}  (${s.key})`);
      at.dataset.field = "source";
      details.append(at);
      if (s.text !== null && s.text !== undefined) {
        const pre = el("pre", "sv-line", s.text);
        pre.dataset.field = "line";
        details.append(pre);
      }
    }
    details.append(el("h3", null, "settings"));
    details.append(settings(n.settings));
  }
  function settings(value) {
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      return el("code", "sv-value", JSON.stringify(value));
    }
    const dl = el("dl", "sv-settings");
    for (const [k, v] of Object.entries(value)) {
      dl.append(el("dt", null, k));
      const dd = el("dd");
      dd.append(v !== null && typeof v === "object" && !Array.isArray(v) ? settings(v) : el("code", "sv-value", JSON.stringify(v)));
      dl.append(dd);
    }
    return dl;
  }

  // -- hover ---------------------------------------------------------------------------------------
  canvas.addEventListener("mousemove", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node[data-path]");
    if (!g) {
      tip.hidden = true;
      return;
    }
    const n = nodes[g.dataset.path];
    if (tip.dataset.path !== n.path) {
      tip.dataset.path = n.path;
      tip.replaceChildren(el("b", null, n.path), el("div", null, `${n.op} · ${n.shape || "—"}`));
      if (n.params) tip.append(el("div", null, `${n.params_text} params`));
      if (n.flops) tip.append(el("div", null, n.flops_text));
      if (n.source && n.source.line) tip.append(el("div", "sv-tip-at", `${n.source.file}:${n.source.line}`));
    }
    tip.hidden = false;
    tip.style.left = `${ev.clientX + 14}px`;
    tip.style.top = `${ev.clientY + 14}px`;
  });
  canvas.addEventListener("mouseleave", () => (tip.hidden = true));
  canvas.addEventListener("click", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node, g.cluster");
    if (!g) return;
    if (g.dataset.path) select(g.dataset.path);
    else if (g.dataset.run) toggle(g.dataset.run);
  });

  // -- search --------------------------------------------------------------------------------------
  function matches(query) {
    const q = query.trim().toLowerCase();
    if (!q) return [];
    const found = data.order.filter((p) => p.toLowerCase().includes(q));
    found.sort((a, b) => (b.toLowerCase() === q) - (a.toLowerCase() === q));
    return found;
  }
  search.addEventListener("input", () => {
    const found = matches(search.value);
    state.matches = found;
    results.replaceChildren();
    for (const path of found.slice(0, 50)) {
      const li = el("li", "sv-result");
      const b = el("button", null, path);
      b.type = "button";
      b.dataset.path = path;
      b.append(el("span", "sv-result-op", ` ${nodes[path].op}`));
      b.addEventListener("click", () => {
        results.replaceChildren();
        reveal(path);
      });
      li.append(b);
      results.append(li);
    }
    if (found.length > 50) results.append(el("li", "sv-more", `${found.length - 50} more`));
    if (search.value.trim() && !found.length) results.append(el("li", "sv-more", "no node has that in its path"));
    highlight();
  });
  search.addEventListener("focus", () => search.dispatchEvent(new Event("input")));
  search.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") {
      const found = matches(search.value);
      if (found.length) {
        results.replaceChildren();
        reveal(found[0]);
      }
    } else if (ev.key === "Escape") {
      search.value = "";
      search.dispatchEvent(new Event("input"));
    }
  });

  details.append(el("p", "sv-hint", "Hover over a box for its figures; click it for its settings and spec line. Click a folded block (or its button above) to expand it."));
  show();
  if (state.selected) select(state.selected);
  const api = {
    reveal,
    select,
    toggle,
    expanded: () => [...state.expanded],
    update: (next) => specvitView(root, next, { expanded: [...state.expanded], selected: state.selected, zoom: state.zoom }),
  };
  root.specvit = api;
  return api;
}
