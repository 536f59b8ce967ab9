/* specvit serve's page: the editor (CodeMirror 5), the problems marked at their lines, the interactive
 * diagram (view.js's specvitView), the summary, save, downloads and diff, over the server's JSON API
 * (specvit/serve/server.py).
 *
 * Typing schedules a check DEBOUNCE ms after the last keystroke; a newer check aborts the older one (and the
 * server skips one overtaken before its turn). A check asks first for the problems alone (validation, fast)
 * and marks them; an invalid spec greys the last good diagram; a valid one is lowered next, redrawing the
 * diagram with its folded picture, and once typing pauses for PAUSE ms the expanded pictures are asked for. Every string from the server is written as text, never as markup. window.specvitServe exposes
 * the editor and the state (the browser tests read the timings from it).
 */
"use strict";

(function () {
  const DEBOUNCE = 80; // ms after the last keystroke before the text is checked
  const PAUSE = 1000; // ms without typing before the expanded pictures (seconds of Graphviz when deep) are asked for
  const $ = (id) => document.getElementById(id);
  const state = {
    name: null, version: null, saved: null, files: [], presets: [], seq: 0, pending: null, timer: null,
    keyAt: 0, signature: null, data: null, view: null, valid: null, timings: [], marks: [], lines: [],
    checks: 0, checked: null, wanted: null, later: null,
  };

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  async function api(path, body, opts) {
    const { signal, raw } = opts || {};
    const init = body === undefined ? { signal } : {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
    };
    const r = await fetch(path, init);
    if (raw && r.ok) return r;
    const data = await r.json().catch(() => ({ error: `the server answered ${r.status}` }));
    if (!r.ok) {
      const e = new Error(data.error || `the server answered ${r.status}`);
      e.status = r.status;
      throw e;
    }
    return data;
  }

  // -- the editor ----------------------------------------------------------------------------------
  const cm = CodeMirror($("sp-editor"), {
    mode: "yaml", lineNumbers: true, indentUnit: 2, tabSize: 2, gutters: ["sp-gutter", "CodeMirror-linenumbers"],
    extraKeys: {
      Tab: (c) => c.execCommand("insertSoftTab"), "Ctrl-Space": complete,
    },
  });
  cm.on("changes", () => {
    state.keyAt = performance.now();
    clearTimeout(state.later);
    showDirty();
    clearTimeout(state.timer);
    state.timer = setTimeout(check, DEBOUNCE);
  });
  cm.on("inputRead", (c) => { if (extendsAt(c)) complete(c); });

  function extendsAt(c) {
    const cur = c.getCursor();
    const m = /^(extends:\s*)(\S*)$/.exec(c.getLine(cur.line).slice(0, cur.ch));
    return m ? { line: cur.line, from: m[1].length, to: cur.ch, typed: m[2] } : null;
  }
  function complete(c) {
    const at = extendsAt(c);
    if (!at) return CodeMirror.Pass;
    const here = state.name && state.name.includes("/") ? state.name.replace(/[^/]*$/, "") : "";
    const local = state.files.filter((f) => f !== state.name && f.startsWith(here)).map((f) => f.slice(here.length));
    const words = [...local, ...state.presets.map((p) => `${p}.yaml`)];
    const list = words.filter((w) => w.startsWith(at.typed));
    c.showHint({
      completeSingle: false,
      hint: () => ({ list, from: CodeMirror.Pos(at.line, at.from), to: CodeMirror.Pos(at.line, at.to) }),
    });
    return undefined;
  }

  // -- checking --------------------------------------------------------------------------------------
  async function check() {
    const text = cm.getValue();
    const name = state.name;
    const seq = ++state.seq;
    const keyAt = state.keyAt;
    if (state.pending) state.pending.abort();
    const ctl = (state.pending = new AbortController());
    const ask = async (path) => {
      try {
        const res = await api(path, { name, text }, { signal: ctl.signal });
        return seq === state.seq && !res.stale ? res : null;
      } catch (e) {
        if (e.name !== "AbortError" && seq === state.seq) {
          state.pending = null;
          problems([{ here: false, line: 0, message: e.message, hint: "" }], name);
        }
        return null;
      }
    };
    // first the problems alone (validation, no lowering: fast), then the diagram and the table
    const found = await ask("/api/validate");
    if (!found) return;
    problems(found.problems, name);
    if (keyAt) timed({ kind: "problems", ms: performance.now() - keyAt, server: found.timings, ok: found.ok, text });
    if (!found.ok) {
      state.pending = null;
      state.checks += 1;
      state.checked = text;
    state.checked = text; // the text the page now shows the answer for
      state.valid = false;
      $("sp-diagram-wrap").classList.add("sp-stale");
      const n = found.problems.length;
      banner(state.data ? `${n} problem${n === 1 ? "" : "s"}: the diagram is the last valid version's` : "no valid version yet");
      return;
    }
    const res = await ask("/api/check");
    if (!res) return;
    state.pending = null;
    state.checks += 1;
    state.checked = text; // the text the page now shows the answer for
    state.valid = res.ok;
    if (!res.ok) {
      // valid, yet lowering it failed: said as its problems
      problems(res.problems, name);
      $("sp-diagram-wrap").classList.add("sp-stale");
      banner("the spec could not be lowered: the diagram is the last valid version's");
      return;
    }
    banner(res.diagram_error || "");
    $("sp-diagram-wrap").classList.remove("sp-stale");
    state.signature = res.signature;
    if (Object.keys(res.data.layouts).length) draw(res.data);
    summary(res.summary);
    if (keyAt) timed({ kind: "diagram", ms: performance.now() - keyAt, server: res.timings, text });
    // the expanded pictures once the typing pauses: laying out every block of a deep spec takes seconds
    clearTimeout(state.later);
    if (!res.complete && !res.diagram_error) state.later = setTimeout(() => layouts(name, text, res.signature), PAUSE);
  }

  function timed(entry) {
    // keystroke -> problems marked, keystroke -> diagram redrawn: the last 50 of each, for the browser test
    state.timings.push(entry);
    if (state.timings.length > 100) state.timings.shift();
  }

  function draw(data) {
    const before = state.view ? state.view.expanded() : [];
    if (before.length && !(before.join("\n") in data.layouts)) state.wanted = before; // until laid out
    state.data = data;
    state.view = state.view ? state.view.update(data) : specvitView($("sp-diagram"), data);
  }

  async function layouts(name, text, signature) {
    let res;
    try {
      res = await api("/api/layouts", { name, text, signature });
    } catch (e) {
      return; // the folded picture stays; its runs say they are being laid out
    }
    if (!res.ok || res.signature !== signature || state.signature !== signature || !state.data) return;
    state.data.layouts = res.layouts;
    const laid = new Map(res.groups.map((g) => [g.id, g]));
    for (const g of state.data.groups) Object.assign(g, { expandable: false, why: "" }, laid.get(g.id));
    draw(state.data);
    const open = new Set(state.view.expanded());
    for (const id of state.wanted || []) if (!open.has(id)) state.view.toggle(id);
    state.wanted = null;
  }

  function banner(text) {
    const b = $("sp-banner");
    b.textContent = text;
    b.hidden = !text;
  }

  // -- problems: the list and the editor's marks -------------------------------------------------------
  function problems(found, name) {
    for (const m of state.marks) m.clear();
    for (const l of state.lines) cm.removeLineClass(l, "background", "sp-error-line");
    state.marks = [];
    state.lines = [];
    cm.clearGutter("sp-gutter");
    const box = $("sp-problems");
    box.replaceChildren();
    if (!found.length) {
      box.append(el("p", "sp-ok", "no problems"));
      return;
    }
    const head = el("p", "sp-count", `${found.length} problem${found.length === 1 ? "" : "s"}`);
    const list = el("ul", "sp-list-problems");
    const extendsLine = cm.getValue().split("\n").findIndex((l) => /^extends:/.test(l));
    const gutter = new Map();
    for (const p of found) {
      const item = el("li", "sp-problem");
      const where = p.line ? (p.here ? `line ${p.line}${p.col ? `:${p.col}` : ""}` : `${p.file}:${p.line}`) : p.file || name;
      item.append(el("span", "sp-at", where), " ");
      if (p.path) item.append(el("code", "sp-key", p.path), ": ");
      item.append(el("span", "sp-message", p.message));
      if (p.hint) item.append(el("div", "sp-fix", `fix: ${p.hint}`));
      const line = p.here && p.line ? p.line - 1 : !p.here && p.line && extendsLine >= 0 ? extendsLine : -1;
      if (line >= 0 && line < cm.lineCount()) {
        const title = p.here ? `${p.message}${p.hint ? ` (fix: ${p.hint})` : ""}` : `in ${p.file}:${p.line}: ${p.message}`;
        mark(line, p.here ? p.col : 0, title);
        gutter.set(line, [...(gutter.get(line) || []), title]);
        item.dataset.line = String(line + 1);
        item.addEventListener("click", () => {
          cm.focus();
          cm.setCursor(CodeMirror.Pos(line, p.here && p.col ? p.col - 1 : 0));
        });
      }
      list.append(item);
    }
    for (const [line, titles] of gutter) {
      const g = el("div", "sp-gutter-mark", "●");
      g.title = titles.join("\n");
      cm.setGutterMarker(line, "sp-gutter", g);
      cm.addLineClass(line, "background", "sp-error-line");
      state.lines.push(line);
    }
    box.append(head, list);
  }

  function mark(line, col, title) {
    const text = cm.getLine(line);
    let from = Math.max(0, Math.min((col || 1) - 1, text.length));
    let to = from;
    while (to < text.length && !/[\s:,\]}]/.test(text[to])) to++;
    if (to === from) {
      // at the end of a line or on a separator: the line's text
      from = text.search(/\S/) < 0 ? 0 : text.search(/\S/);
      to = Math.max(text.length, from + 1);
    }
    const m = cm.markText(CodeMirror.Pos(line, from), CodeMirror.Pos(line, to), {
      className: "sp-mark", title, attributes: { "data-line": String(line + 1) }, clearWhenEmpty: false,
    });
    state.marks.push(m);
  }

  // -- summary -----------------------------------------------------------------------------------
  function summary(s) {
    const table = el("table", "sp-table");
    const head = el("tr");
    for (const h of ["path", "op", "output shape", "params", s.unit, "useful", "×"]) head.append(el("th", null, h));
    table.append(el("thead"));
    table.tHead.append(head);
    const body = el("tbody");
    for (const r of s.rows) {
      const tr = el("tr");
      for (const v of [r.path, r.op, r.shape, r.params, r.flops, r.useful, r.count > 1 ? `×${r.count}` : ""]) tr.append(el("td", null, v));
      tr.addEventListener("click", () => state.view && state.view.reveal(r.path.replace(/\.(\d+)-\d+\./, ".$1.")));
      body.append(tr);
    }
    table.append(body);
    $("sp-summary").replaceChildren(table, el("pre", "sp-totals", s.totals.join("\n")));
  }

  // -- files: open, new, save ------------------------------------------------------------------------
  function template(name) {
    const stem = name.replace(/^.*\//, "").replace(/\.ya?ml$/i, "").replace(/[^A-Za-z0-9_]/g, "_") || "model";
    return `specvit: 1\nname: ${stem}\nextends: vit_tiny_patch16_224.yaml\nencoder:\n  depth: 6\n`;
  }
  function dirty() {
    return state.saved === null || cm.getValue() !== state.saved;
  }
  function showDirty() {
    const d = dirty();
    $("sp-status").textContent = d ? (state.version ? "modified" : "new file, not saved") : "saved";
    $("sp-status").dataset.state = d ? "modified" : "saved";
    document.title = `${d ? "• " : ""}${state.name || ""} · specvit serve`;
  }
  async function open(name, fresh) {
    let text;
    let version = null;
    try {
      const res = await api(`/api/file?name=${encodeURIComponent(name)}`);
      text = res.text;
      version = res.version;
    } catch (e) {
      if (e.status !== 404) {
        problems([{ here: false, line: 0, message: e.message, hint: "" }], name);
        return;
      }
      text = fresh || template(name);
    }
    state.name = name;
    state.version = version;
    state.saved = version ? text : null;
    $("sp-name").textContent = name;
    $("sp-conflict").hidden = true;
    history.replaceState(null, "", `#${encodeURI(name)}`);
    cm.setValue(text);
    cm.clearHistory();
    clearTimeout(state.timer);
    state.keyAt = 0; // a file opened, not a keystroke: not timed
    showDirty();
    listFiles();
    check();
  }
  async function save(force) {
    const text = cm.getValue();
    try {
      const res = await api("/api/save", { name: state.name, text, version: state.version, force });
      state.version = res.version;
      state.saved = text;
      $("sp-conflict").hidden = true;
      showDirty();
      $("sp-status").textContent = `saved at ${new Date().toLocaleTimeString()}`;
      if (!state.files.includes(state.name)) load();
    } catch (e) {
      if (e.status === 409) {
        $("sp-conflict-text").textContent = e.message;
        $("sp-conflict").hidden = false;
      } else {
        $("sp-status").textContent = `not saved: ${e.message}`;
      }
      $("sp-status").dataset.state = "error";
    }
  }
  function listFiles() {
    const list = $("sp-list");
    list.replaceChildren();
    for (const f of state.files) {
      const li = el("li");
      const b = el("button", f === state.name ? "sp-file sp-current" : "sp-file", f);
      b.type = "button";
      b.addEventListener("click", () => {
        if (f !== state.name && (!dirty() || window.confirm(`Discard the unsaved changes to ${state.name}?`))) open(f);
      });
      li.append(b);
      list.append(li);
    }
    const choices = $("sp-choices");
    choices.replaceChildren();
    for (const w of [...state.files, ...state.presets]) {
      const o = el("option");
      o.value = w;
      choices.append(o);
    }
  }
  async function load() {
    const res = await api("/api/files");
    state.files = res.files;
    state.presets = res.presets;
    $("sp-root").textContent = res.root;
    listFiles();
    return res;
  }

  // -- downloads and diff ------------------------------------------------------------------------------
  async function download(format) {
    const status = $("sp-download-status");
    status.textContent = `preparing ${format}…`;
    try {
      const r = await api("/api/download", { name: state.name, text: cm.getValue(), format }, { raw: true });
      const blob = await r.blob();
      const found = /filename="([^"]+)"/.exec(r.headers.get("Content-Disposition") || "");
      const a = el("a");
      a.href = URL.createObjectURL(blob);
      a.download = found ? found[1] : `model.${format}`;
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(a.href), 10000);
      status.textContent = `downloaded ${a.download}`;
    } catch (e) {
      status.textContent = `no ${format}: ${e.message}`;
    }
  }
  async function diff(other) {
    const out = $("sp-diff");
    out.replaceChildren(el("p", "sp-note", "comparing…"));
    try {
      const res = await api("/api/diff", { name: state.name, text: cm.getValue(), other });
      if (!res.ok) {
        out.replaceChildren(el("p", "sp-note", "fix the spec's problems to compare it"));
        return;
      }
      const delta = (k) => `${res.a[k].toLocaleString("en-US")} → ${res.b[k].toLocaleString("en-US")}`;
      const lines = [el("p", "sp-note", `${res.a.name} → ${res.b.name} (this spec): params ${delta("params")}, FLOPs ${delta("flops")}`)];
      if (res.same) lines.push(el("p", "sp-ok", "the same model"));
      const table = el("table", "sp-table sp-diff-table");
      for (const r of res.rows) {
        const tr = el("tr", `sp-${r.status}`);
        for (const v of [r.status, r.path, r.op, r.text]) tr.append(el("td", null, v));
        table.append(tr);
      }
      if (res.rows.length) lines.push(table);
      out.replaceChildren(...lines);
    } catch (e) {
      out.replaceChildren(el("p", "sp-error", e.message));
    }
  }

  // -- wiring --------------------------------------------------------------------------------------
  $("sp-save").addEventListener("click", () => save(false));
  document.addEventListener("keydown", (ev) => {
    if ((ev.ctrlKey || ev.metaKey) && !ev.altKey && ev.key.toLowerCase() === "s") {
      ev.preventDefault(); // Ctrl-S (Cmd-S) saves wherever the focus is, not the browser's "save page"
      save(false);
    }
  });
  $("sp-overwrite").addEventListener("click", () => save(true));
  $("sp-reload").addEventListener("click", () => open(state.name));
  for (const b of document.querySelectorAll("[data-format]")) b.addEventListener("click", () => download(b.dataset.format));
  $("sp-diff-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    diff($("sp-diff-with").value);
  });
  $("sp-new").addEventListener("submit", (ev) => {
    ev.preventDefault();
    let name = $("sp-new-name").value.trim();
    if (!name) return;
    if (!/\.ya?ml$/i.test(name)) name += ".yaml";
    if (!dirty() || window.confirm(`Discard the unsaved changes to ${state.name}?`)) open(name);
  });
  window.addEventListener("beforeunload", (ev) => {
    if (state.name && dirty() && cm.getValue() !== template(state.name)) ev.preventDefault();
  });
  window.specvitServe = { cm, state, open, save, check };

  load().then((res) => {
    const asked = decodeURI(location.hash.slice(1));
    const name = asked || res.opened;
    if (name) open(name);
    else open("model.yaml");
  }, (e) => problems([{ here: false, line: 0, message: e.message, hint: "" }], ""));
})();
