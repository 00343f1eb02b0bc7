/* rlpipe run report: the fate chart (stacked bars of completions by status and step, totals table) and
   the rollout browser (filter by status, reward, length, step and text; sort; paginate; a row opens its detail).
   report.js calls window.rlpipeRollouts(data, ui) with its DOM helpers; no dependencies.
   The browser's state lives in the URL hash, e.g. #rollouts?status=trained,stale&q=36&reward=0:1&sort=-reward&page=2,
   so a filtered view can be linked (and the browser test drives it that way). */
(function () {
  "use strict";

  window.rlpipeRollouts = function (data, ui) {
    const { h, s, fmt, notes } = ui;
    const statusColor = Object.fromEntries((data.fates.statuses || []).map((st) => [st.name, st.color]));
    const chip = (status) => h("span", { class: "chip", style: "background:" + (statusColor[status] || "#4d4d4d") });
    // ------------------------------------------------------------ fate of completions per step

    function fatesSection() {
      const sec = data.fates;
      const node = h("section", { id: sec.id }, [h("h2", { text: sec.title })].concat(notes(sec.notes)));
      if (!sec.runs.length) {
        if (!sec.notes.length) node.append(h("div", { class: "note", text: "No sampled completions yet." }));
        return node;
      }
      const names = sec.statuses.map((st) => st.name);
      node.append(h("div", { class: "legend fate-legend" }, names.map((name) =>
        h("span", {}, [chip(name), document.createTextNode(name)]))));
      for (const run of sec.runs) node.append(fateChart(run, names));
      node.append(totalsTable(sec.runs, names));
      return node;
    }

    function fateChart(run, names) {
      const W = 940, H = 250, M = { l: 54, r: 12, t: 8, b: 32 };
      const card = h("div", { class: "card wide" }, [h("div", { class: "head" }, [
        h("h3", { text: (data.runs.length > 1 ? run.run_id + ": " : "") + "completions by final status" }),
        h("span", { class: "src", text: "fates_by_step.sql" })]),
      h("div", { class: "sub", text: "per step that sampled them; hover for counts" })]);
      const n = run.steps.length;
      const stepTotals = run.steps.map((_, i) => names.reduce((sum, name) => sum + run.counts[name][i], 0));
      const yTicks = ui.ticks(0, Math.max(1, ...stepTotals), 5, true);
      const last = yTicks[yTicks.length - 1], y1 = last < Math.max(...stepTotals) ? last + (yTicks[1] - yTicks[0]) : last;
      const band = (W - M.l - M.r) / n, bar = Math.max(1, band * 0.84);
      const bx = (i) => M.l + i * band + (band - bar) / 2;
      const sy = (y) => H - M.b - y / y1 * (H - M.t - M.b);
      const svg = s("svg", { class: "fate-chart", viewBox: `0 0 ${W} ${H}`, "data-run-id": run.run_id,
        "data-total": run.total }, card);
      for (const y of ui.ticks(0, y1, 5, true)) {  // y1 is a tick: the tallest bar stays under the top line
        s("line", { class: "grid-line", x1: M.l, x2: W - M.r, y1: sy(y), y2: sy(y) }, svg);
        s("text", { x: M.l - 6, y: sy(y) + 3.5, "text-anchor": "end", text: fmt(y) }, svg);
      }
      for (const step of ui.ticks(run.steps[0], run.steps[n - 1] + 1e-9, 8, true)) {
        const i = run.steps.indexOf(step);
        if (i >= 0) s("text", { x: bx(i) + bar / 2, y: H - M.b + 14, "text-anchor": "middle", text: String(step) }, svg);
      }
      s("line", { class: "axis", x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }, svg);
      s("text", { x: (M.l + W - M.r) / 2, y: H - 3, "text-anchor": "middle", text: "step" }, svg);
      s("text", { x: 11, y: (M.t + H - M.b) / 2, "text-anchor": "middle",
        transform: `rotate(-90 11 ${(M.t + H - M.b) / 2})`, text: "completions" }, svg);
      run.steps.forEach((step, i) => {
        let base = 0;
        for (const name of names) {
          const count = run.counts[name][i];
          if (!count) continue;
          s("rect", { x: bx(i), width: bar, y: sy(base + count), height: sy(base) - sy(base + count),
            fill: statusColor[name], "data-status": name, "data-step": step, "data-n": count }, svg);
          base += count;
        }
      });
      const guide = s("rect", { class: "guide-band", x: 0, width: band, y: M.t, height: H - M.t - M.b, visibility: "hidden" }, svg);
      svg.addEventListener("mousemove", (event) => {
        const box = svg.getBoundingClientRect();
        const x = (event.clientX - box.left) * W / box.width;
        const i = Math.max(0, Math.min(n - 1, Math.floor((x - M.l) / band)));
        guide.setAttribute("x", M.l + i * band); guide.setAttribute("visibility", "visible");
        ui.tip.replaceChildren(h("b", { text: `step ${run.steps[i]}: ${stepTotals[i]} completions` }));
        for (const name of names.slice().reverse()) {
          if (run.counts[name][i]) ui.tip.append(h("div", {}, [chip(name), document.createTextNode(
            `${name}: ${run.counts[name][i]} (${fmt(run.counts[name][i] / stepTotals[i], true)})`)]));
        }
        ui.showTip(event);
      });
      svg.addEventListener("mouseleave", () => { ui.tip.hidden = true; guide.setAttribute("visibility", "hidden"); });
      return card;
    }

    function totalsTable(runs, names) {
      const multi = runs.length > 1;
      const head = h("tr", {}, [h("th", { text: "status" })].concat(runs.flatMap((run) => [
        h("th", { class: "num", text: multi ? run.run_id : "completions" }), h("th", { class: "num", text: "share" })])));
      const row = (name, cells) => h("tr", { "data-status": name }, [h("td", {}, [chip(name), document.createTextNode(name)])].concat(cells));
      const body = names.map((name) => row(name, runs.flatMap((run) => [
        h("td", { class: "num", "data-n": run.totals[name], text: String(run.totals[name]) }),
        h("td", { class: "num", text: fmt(run.totals[name] / (run.total || 1), true) })])));
      body.push(h("tr", { class: "total", "data-status": "all" }, [h("td", { text: "all" })].concat(runs.flatMap((run) => [
        h("td", { class: "num", "data-n": run.total, text: String(run.total) }), h("td", { class: "num", text: "100%" })]))));
      return h("div", { class: "table-wrap fit", id: "fate-totals" }, [h("table", {}, [h("thead", {}, [head]), h("tbody", {}, body)])]);
    }

    // ------------------------------------------------------------ the rollout browser

    function browserSection() {
      const sec = data.rollouts;
      const node = h("section", { id: sec.id }, [h("h2", { text: sec.title })].concat(notes(sec.notes)));
      if (!sec.n) {
        if (!sec.notes.length) node.append(h("div", { class: "note", text: "No sampled completions yet." }));
        return node;
      }
      const R = decode(sec);
      const state = { statuses: new Set(sec.statuses), q: "", reward: [null, null], tokens: [null, null],
        step: [null, null], sort: null, page: 1, size: 50, open: null };
      const controls = browserControls(sec, state, () => { state.page = 1; update(); });
      const summary = h("div", { class: "summary", id: "rollouts-summary" });
      const holder = h("div", { id: "rollouts-table" });
      const pager = h("div", { class: "pager" });
      const detail = h("div", { class: "detail", id: "rollout-detail", hidden: "" });
      node.append(controls.node, summary, holder, pager, detail);
      let shown = [];

      function update(keepHash) {
        shown = [];
        const q = state.q.toLowerCase();
        for (let i = 0; i < R.n; i++) if (matches(R, i, state, q)) shown.push(i);
        if (state.sort) sortRows(R, shown, state.sort);
        const pages = Math.max(1, Math.ceil(shown.length / state.size));
        state.page = Math.min(Math.max(1, state.page), pages);
        const first = (state.page - 1) * state.size, page = shown.slice(first, first + state.size);
        summary.setAttribute("data-matched", shown.length);
        summary.setAttribute("data-total", R.n);
        summary.textContent = `${shown.length.toLocaleString("en")} of ${R.n.toLocaleString("en")} completions match` +
          (shown.length ? ` · showing ${first + 1}–${first + page.length}` : "") + " · click a row for its detail";
        holder.replaceChildren(rowsTable(R, page, state, (key) => {
          state.sort = state.sort && state.sort.key === key ? { key, desc: !state.sort.desc } : { key, desc: key !== "step" };
          update();
        }, openRow));
        pager.replaceChildren(...pagerButtons(state.page, pages, (p) => { state.page = p; update(); }),
          sizeSelect(state, () => { state.page = 1; update(); }));
        if (!keepHash) writeHash(state);
      }

      function openRow(i) {
        state.open = i === null ? null : R.sampleId(i);
        if (i === null) { detail.hidden = true; writeHash(state); return; }
        detail.replaceChildren(detailView(R, i, () => openRow(null)));
        detail.hidden = false;
        for (const tr of holder.querySelectorAll("tr.selected")) tr.classList.remove("selected");
        const tr = holder.querySelector(`tr[data-row="${i}"]`);
        if (tr) tr.classList.add("selected");
        writeHash(state);
      }

      readHash(state);
      controls.sync();
      update(true);
      if (state.open !== null) {
        const i = R.rowOf(state.open);
        if (i >= 0) openRow(i);
      }
      return node;
    }

    // the columnar data back into per-row accessors
    // (the encodings: report_rollouts.py's dict_encode, affix_encode and numbers)
    function decode(sec) {
      const G = sec.groups, S = sec.rows;
      const col = (enc) => enc.index.map((k) => enc.values[k]);
      const nums = (text) => text.split(",").map((v) => (v === "" ? null : Number(v)));
      const affix = (enc) => enc.values.map((v) => (v === null ? null : enc.prefix + v + enc.suffix));
      let at = 0;
      const g = nums(S.g).map((delta) => (at += delta));
      const groupId = affix(G.group_id), exampleId = affix(G.example_id), step = nums(G.step), version = nums(G.policy_version);
      const runOf = col(G.run_id), envOf = col(G.env), prompts = { index: G.prompt.index, values: affix(G.prompt.values) };
      const full = new Set(sec.full_ids);
      const R = {
        n: sec.n, status: col(S.status), reason: S.reason, finish: S.finish, g: g,
        reward: nums(S.reward), advantage: nums(S.advantage), tokens: nums(S.tokens), trained: nums(S.trained_step),
        completion: S.completion,
        step: (i) => step[g[i]], version: (i) => version[g[i]], run: (i) => runOf[g[i]],
        env: (i) => envOf[g[i]], example: (i) => exampleId[g[i]], group: (i) => groupId[g[i]],
        prompt: (i) => prompts.values[prompts.index[g[i]]],
        sampleId: (i) => (full.has(i) ? S.sid[i] : groupId[g[i]] + S.sid[i]),
        reasonOf: (i) => S.reason.values[S.reason.index[i]], finishOf: (i) => S.finish.values[S.finish.index[i]],
        episode: (i) => sec.episodes[String(i)] || null,
        promptIndex: prompts.index, lowerPrompt: prompts.values.map((text) => (text || "").toLowerCase()), lowerCompletion: [],
        rowOf: (id) => { for (let i = 0; i < sec.n; i++) if (R.sampleId(i) === id) return i; return -1; },
      };
      return R;
    }

    function matches(R, i, state, q) {
      if (!state.statuses.has(R.status[i])) return false;
      if (!within(R.reward[i], state.reward) || !within(R.tokens[i], state.tokens) || !within(R.step(i), state.step)) return false;
      if (!q) return true;
      if (R.lowerPrompt[R.promptIndex[R.g[i]]].includes(q)) return true;
      if (R.lowerCompletion[i] === undefined) R.lowerCompletion[i] = (R.completion[i] || "").toLowerCase();
      return R.lowerCompletion[i].includes(q);
    }

    function within(value, [lo, hi]) {
      if (lo === null && hi === null) return true;
      if (value === null || value === undefined) return false;
      return (lo === null || value >= lo) && (hi === null || value <= hi);
    }

    const SORTS = {
      step: (R, i) => R.step(i), version: (R, i) => R.version(i), status: (R, i) => R.status[i],
      reward: (R, i) => R.reward[i], advantage: (R, i) => R.advantage[i], tokens: (R, i) => R.tokens[i],
      trained: (R, i) => R.trained[i],
    };

    // stable; missing values last in both directions
    function sortRows(R, rows, sort) {
      const key = SORTS[sort.key], sign = sort.desc ? -1 : 1;
      const values = new Map(rows.map((i) => [i, key(R, i)]));
      rows.sort((a, b) => {
        const va = values.get(a), vb = values.get(b);
        const na = va === null || va === undefined, nb = vb === null || vb === undefined;
        if (na || nb) return na === nb ? a - b : na ? 1 : -1;
        return va < vb ? -sign : va > vb ? sign : a - b;
      });
    }

    function browserControls(sec, state, changed) {
      const counts = {};
      const S = sec.rows.status;
      for (const k of S.index) counts[S.values[k]] = (counts[S.values[k]] || 0) + 1;
      const boxes = sec.statuses.map((name) => {
        const box = h("input", { type: "checkbox", value: name, "data-status": name });
        box.addEventListener("change", () => { box.checked ? state.statuses.add(name) : state.statuses.delete(name); changed(); });
        return [name, box];
      });
      const text = h("input", { type: "search", placeholder: "text in prompt or completion", id: "rollouts-q", size: 28 });
      let timer = null;
      text.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => { state.q = text.value; changed(); }, 150); });
      const ranges = ["reward", "tokens", "step"].map((key) => {
        const lo = h("input", { type: "number", step: "any", placeholder: "min", "data-range": key + "-min" });
        const hi = h("input", { type: "number", step: "any", placeholder: "max", "data-range": key + "-max" });
        const read = () => { state[key] = [lo.value === "" ? null : Number(lo.value), hi.value === "" ? null : Number(hi.value)]; changed(); };
        lo.addEventListener("change", read); hi.addEventListener("change", read);
        return [key, lo, hi];
      });
      const all = h("button", { type: "button", text: "all" }), none = h("button", { type: "button", text: "none" });
      all.addEventListener("click", () => { sec.statuses.forEach((n) => state.statuses.add(n)); sync(); changed(); });
      none.addEventListener("click", () => { state.statuses.clear(); sync(); changed(); });
      function sync() {
        for (const [name, box] of boxes) box.checked = state.statuses.has(name);
        text.value = state.q;
        for (const [key, lo, hi] of ranges) { lo.value = state[key][0] ?? ""; hi.value = state[key][1] ?? ""; }
      }
      const node = h("div", { class: "browser-controls" }, [
        h("div", { class: "statuses" }, [h("span", { class: "label", text: "status" })].concat(
          boxes.map(([name, box]) => h("label", {}, [box, chip(name), document.createTextNode(`${name} (${counts[name] || 0})`)])),
          [all, none])),
        h("div", { class: "filters" }, [h("label", {}, [document.createTextNode("text "), text])].concat(
          ranges.map(([key, lo, hi]) => h("label", {}, [document.createTextNode(key === "tokens" ? "length (tokens) " : key + " "), lo,
            document.createTextNode(" – "), hi]))))]);
      return { node, sync };
    }

    const COLUMNS = [
      ["step", "step", (R, i) => num(R.step(i))], ["version", "policy", (R, i) => num(R.version(i))],
      ["status", "status", (R, i) => h("td", { class: "status" }, [chip(R.status[i]), document.createTextNode(R.status[i])])],
      ["reward", "reward", (R, i) => num(R.reward[i])], ["advantage", "advantage", (R, i) => num(R.advantage[i])],
      ["tokens", "tokens", (R, i) => h("td", { class: "num", text: `${R.tokens[i]} ${R.finishOf(i) === "length" ? "(cut)" : ""}` })],
      [null, "prompt", (R, i) => h("td", { class: "clip", text: oneLine(R.prompt(i), 90) })],
      [null, "completion", (R, i) => h("td", { class: "clip", text: (R.episode(i) ? `[${R.episode(i).n_turns} turns] ` : "") + oneLine(R.completion[i], 140) })],
    ];
    const num = (value) => h("td", { class: "num", text: ui.fmt(value) });
    const oneLine = (text, n) => { const t = (text || "").replace(/\s+/g, " ").trim(); return t.length > n ? t.slice(0, n - 1) + "…" : t; };

    function rowsTable(R, page, state, sortBy, open) {
      const columns = (data.runs.length > 1 ? [[null, "run", (R_, i) => h("td", { class: "run", text: R_.run(i) })]] : []).concat(COLUMNS);
      const head = h("tr", {}, columns.map(([key, label]) => {
        if (!key) return h("th", { text: label });
        const mark = state.sort && state.sort.key === key ? (state.sort.desc ? " ▼" : " ▲") : "";
        const th = h("th", { class: "sortable", "data-sort": key, text: label + mark, title: "sort by " + label });
        th.addEventListener("click", () => sortBy(key));
        return th;
      }));
      const body = page.map((i) => {
        const tr = h("tr", { "data-row": i, "data-sample-id": R.sampleId(i), class: state.open === R.sampleId(i) ? "selected" : "" },
          columns.map(([, , cell]) => cell(R, i)));
        tr.addEventListener("click", () => { open(i); document.getElementById("rollout-detail").scrollIntoView({ block: "nearest" }); });
        return tr;
      });
      return h("div", { class: "table-wrap" }, [h("table", { class: "rollouts" }, [h("thead", {}, [head]), h("tbody", {}, body)])]);
    }

    function pagerButtons(page, pages, go) {
      const button = (label, target, disabled) => {
        const b = h("button", { type: "button", text: label });
        if (disabled) b.disabled = true; else b.addEventListener("click", () => go(target));
        return b;
      };
      return [button("«", 1, page === 1), button("‹", page - 1, page === 1),
        h("span", { class: "page", "data-page": page, "data-pages": pages, text: `page ${page} of ${pages}` }),
        button("›", page + 1, page === pages), button("»", pages, page === pages)];
    }

    function sizeSelect(state, changed) {
      const select = h("select", {}, [25, 50, 100, 200].map((n) => h("option", { value: String(n), text: n + " per page" })));
      select.value = String(state.size);
      select.addEventListener("change", () => { state.size = Number(select.value); changed(); });
      return select;
    }

    function detailView(R, i, close) {
      const ep = R.episode(i);
      const pairs = [["sample", R.sampleId(i)], ["group", R.group(i)], ["run", R.run(i)],
        ["env / example", `${R.env(i)} / ${R.example(i)}`], ["step", R.step(i)], ["policy version", R.version(i)],
        ["fate", R.status[i]], ["reason", R.reasonOf(i)], ["trained at step", R.trained[i]],
        ["reward", ui.fmt(R.reward[i])], ["advantage", ui.fmt(R.advantage[i])],
        ["completion tokens", `${R.tokens[i]} (finish: ${R.finishOf(i) || "?"})`]];
      if (ep) pairs.push(["turns", `${ep.n_turns}: ` + ep.spans.map(([turn, who, length, reward]) =>
        `${turn}.${who} ${length} tok` + (reward === null || reward === undefined ? "" : ` r=${ui.fmt(reward)}`)).join(" · ")]);
      const shut = h("button", { type: "button", class: "close", text: "close ✕" });
      shut.addEventListener("click", close);
      const kv = h("dl", {}, pairs.flatMap(([key, value]) => [h("dt", { text: key }),
        h("dd", { "data-field": key, text: value === null || value === undefined ? "–" : String(value) })]));
      const texts = [h("h4", { text: "prompt" }), h("pre", { "data-field": "prompt", text: R.prompt(i) || "" })];
      if (ep) {
        texts.push(h("h4", { text: "episode transcript" }), h("div", { class: "transcript" }, ep.messages.map(([role, content]) =>
          h("div", { class: "message role-" + role }, [h("span", { class: "role", text: role }), h("pre", { text: content })]))));
      }
      texts.push(h("h4", { text: ep ? "completion (all turns, as tokenised)" : "completion" }),
        h("pre", { "data-field": "completion", text: R.completion[i] || "" }));
      return h("div", { class: "card" }, [h("div", { class: "head" }, [h("h3", { text: "Completion " + R.sampleId(i) }), shut]), kv].concat(texts));
    }

    // ------------------------------------------------------------ state <-> URL hash

    function readHash(state) {
      const hash = decodeURIComponent(location.hash || "");
      if (!hash.startsWith("#rollouts?")) return;
      const params = new URLSearchParams(location.hash.slice("#rollouts?".length));
      if (params.has("status")) state.statuses = new Set(params.get("status").split(",").filter(Boolean));
      if (params.has("q")) state.q = params.get("q");
      for (const key of ["reward", "tokens", "step"]) {
        if (!params.has(key)) continue;
        const [lo, hi] = params.get(key).split(":");
        state[key] = [lo === "" || lo === undefined ? null : Number(lo), hi === "" || hi === undefined ? null : Number(hi)];
      }
      if (params.has("sort")) {
        const sort = params.get("sort");
        const key = sort.replace(/^-/, "");
        if (SORTS[key]) state.sort = { key, desc: sort.startsWith("-") };
      }
      if (params.has("size")) state.size = Number(params.get("size")) || 50;
      if (params.has("page")) state.page = Number(params.get("page")) || 1;
      if (params.has("open")) state.open = params.get("open");
    }

    function writeHash(state) {
      const params = new URLSearchParams();
      const all = data.rollouts.statuses;
      if (state.statuses.size !== all.length) params.set("status", [...state.statuses].join(","));
      if (state.q) params.set("q", state.q);
      for (const key of ["reward", "tokens", "step"]) {
        if (state[key][0] !== null || state[key][1] !== null) params.set(key, `${state[key][0] ?? ""}:${state[key][1] ?? ""}`);
      }
      if (state.sort) params.set("sort", (state.sort.desc ? "-" : "") + state.sort.key);
      if (state.size !== 50) params.set("size", state.size);
      if (state.page > 1) params.set("page", state.page);
      if (state.open !== null) params.set("open", state.open);
      const text = params.toString();
      try { history.replaceState(null, "", text ? "#rollouts?" + text : location.pathname + location.search); } catch (e) { /* file:// in some browsers */ }
    }

    return { fates: fatesSection(), rollouts: browserSection() };
  };
})();
