/* rlpipe run report: draws the JSON of #rlpipe-data as SVG line plots and tables. No dependencies.
   When done, the html element gets data-rlpipe-report = "ok:PLOTS:POINTS" (the browser test reads it). */
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("rlpipe-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const M = { l: 54, r: 12, t: 8, b: 32 };  // margins; plots are W x H in SVG units, scaled to the card
  const color = Object.fromEntries(data.runs.map((run) => [run.run_id, run.color]));
  const DASH = { solid: "", dashed: "6 4", dotted: "1.5 3" };
  const tip = document.getElementById("tip");
  const count = { plots: 0, points: 0 };

  function h(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children || []) if (child) node.append(child);
    return node;
  }

  function s(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    parent.append(node);
    return node;
  }

  function fmt(value, percent) {
    if (value === null || value === undefined) return "–";
    if (percent) return (value * 100).toFixed(Math.abs(value) < 0.1 && value !== 0 ? 1 : 0) + "%";
    const a = Math.abs(value);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return Number(value.toPrecision(3)).toExponential().replace("e+", "e");
    return String(Number(value.toPrecision(4)));
  }

  function ticks(lo, hi, n, integer) {
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), norm = raw / mag;
    let step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }

  function legend(runIds) {
    return h("div", { class: "legend" }, runIds.map((id) =>
      h("span", {}, [h("span", { class: "chip", style: "background:" + color[id] }), document.createTextNode(id)])));
  }

  // consecutive points with a value: a null breaks the line
  function segments(xs, ys) {
    const out = [];
    let current = [];
    xs.forEach((x, i) => {
      if (ys[i] === null || ys[i] === undefined) { if (current.length) out.push(current); current = []; }
      else current.push([x, ys[i]]);
    });
    if (current.length) out.push(current);
    return out;
  }

  function extent(plot) {
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const line of plot.series) {
      const ys = [line.y].concat(line.bands.flatMap((band) => [band.lo, band.hi]));
      line.x.forEach((x, i) => {
        for (const column of ys) {
          const y = column[i];
          if (y === null || y === undefined) continue;
          x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
        }
      });
    }
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (plot.y_range) { y0 = Math.min(y0, plot.y_range[0]); y1 = Math.max(y1, plot.y_range[1]); }
    else if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    else { const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad; }
    return [x0, x1, y0, y1];
  }

  function drawPlot(plot) {
    const card = h("div", { class: "card", id: "plot-" + plot.id }, [
      h("div", { class: "head" }, [h("h3", { text: plot.title }), h("span", { class: "src", text: plot.query + ".sql" })]),
      h("div", { class: "sub", text: plot.subtitle || "" })]);
    if (plot.note) { card.append(h("div", { class: "note", text: plot.note })); return card; }
    const runIds = [...new Set(plot.series.filter((l) => l.style === "solid").map((l) => l.run_id))];
    if (data.runs.length > 1) card.append(legend(runIds));
    const [x0, x1, y0, y1] = extent(plot);
    const W = plot.small ? 340 : 460, H = plot.small ? 190 : 240;
    const sx = (x) => M.l + (x - x0) / (x1 - x0) * (W - M.l - M.r);
    const sy = (y) => H - M.b - (y - y0) / (y1 - y0) * (H - M.t - M.b);
    const svg = s("svg", { class: "plot", viewBox: `0 0 ${W} ${H}`, "data-plot-id": plot.id }, card);
    for (const y of ticks(y0, y1, 5, false)) {
      s("line", { class: "grid-line", x1: M.l, x2: W - M.r, y1: sy(y), y2: sy(y) }, svg);
      s("text", { x: M.l - 6, y: sy(y) + 3.5, "text-anchor": "end", text: fmt(y, plot.percent) }, svg);
    }
    for (const x of ticks(x0, x1, 6, true)) {
      s("line", { class: "grid-line", x1: sx(x), x2: sx(x), y1: M.t, y2: H - M.b }, svg);
      s("text", { x: sx(x), y: H - M.b + 14, "text-anchor": "middle", text: String(x) }, svg);
    }
    s("line", { class: "axis", x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }, svg);
    s("line", { class: "axis", x1: M.l, x2: M.l, y1: M.t, y2: H - M.b }, svg);
    s("text", { x: (M.l + W - M.r) / 2, y: H - 3, "text-anchor": "middle", text: plot.x_label || "step" }, svg);
    s("text", { x: 11, y: (M.t + H - M.b) / 2, "text-anchor": "middle",
      transform: `rotate(-90 11 ${(M.t + H - M.b) / 2})`, text: plot.y_label }, svg);
    let points = 0;
    for (const line of plot.series) {
      line.bands.forEach((band, b) => {
        for (const seg of segments(line.x, line.x.map((_, i) => band.lo[i] === null || band.hi[i] === null ? null : i))) {
          const upper = seg.map(([x, i]) => `${sx(x)},${sy(band.hi[i])}`);
          const lower = seg.slice().reverse().map(([x, i]) => `${sx(x)},${sy(band.lo[i])}`);
          s("polygon", { points: upper.concat(lower).join(" "), fill: color[line.run_id], "fill-opacity": 0.1 + 0.07 * b }, svg);
        }
      });
    }
    for (const line of plot.series) {
      const main = line.style === "solid";
      for (const seg of segments(line.x, line.y)) {
        s("polyline", { points: seg.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "), fill: "none",
          stroke: color[line.run_id], "stroke-width": main ? 2 : 1.3, "stroke-dasharray": DASH[line.style],
          "stroke-linejoin": "round", "stroke-opacity": main ? 1 : 0.8 }, svg);
        if (main && (seg.length === 1 || line.x.length <= 40)) {
          for (const [x, y] of seg) s("circle", { cx: sx(x), cy: sy(y), r: 2.6, fill: color[line.run_id] }, svg);
        }
        if (main) points += seg.length;
      }
    }
    svg.setAttribute("data-points", points);
    count.plots += 1;
    count.points += points;
    hover(svg, plot, sx, x0, x1, W, H);
    return card;
  }

  // a guide line at the nearest step and a tooltip with every line's value there
  function hover(svg, plot, sx, x0, x1, W, H) {
    const guide = s("line", { class: "guide", y1: M.t, y2: H - M.b, visibility: "hidden" }, svg);
    const steps = [...new Set(plot.series.flatMap((line) => line.x))].sort((a, b) => a - b);
    svg.addEventListener("mousemove", (event) => {
      const box = svg.getBoundingClientRect();
      const x = x0 + ((event.clientX - box.left) * W / box.width - M.l) / (W - M.l - M.r) * (x1 - x0);
      const step = steps.reduce((best, v) => (Math.abs(v - x) < Math.abs(best - x) ? v : best), steps[0]);
      guide.setAttribute("x1", sx(step)); guide.setAttribute("x2", sx(step)); guide.setAttribute("visibility", "visible");
      tip.replaceChildren(h("b", { text: "step " + step }));
      for (const line of plot.series) {
        const i = line.x.indexOf(step);
        if (i < 0 || line.y[i] === null) continue;
        const label = line.style === "solid" ? "" : ` (${line.style})`;
        tip.append(h("div", {}, [h("span", { class: "chip", style: "background:" + color[line.run_id] }),
          document.createTextNode(`${line.run_id}${label}: ${fmt(line.y[i], plot.percent)}`)]));
      }
      showTip(event);
    });
    svg.addEventListener("mouseleave", () => { tip.hidden = true; guide.setAttribute("visibility", "hidden"); });
  }

  function showTip(event) {
    tip.hidden = false;
    tip.style.left = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = event.clientY + 12 + "px";
  }

  function notes(list) {
    return (list || []).map((text) => h("div", { class: "note", text: text }));
  }

  function table(columns, rows) {
    const head = h("tr", {}, columns.map(([label]) => h("th", { text: label })));
    const body = rows.map((row) => h("tr", {}, columns.map(([, cell]) => cell(row))));
    return h("div", { class: "table-wrap" }, [h("table", {}, [h("thead", {}, [head]), h("tbody", {}, body)])]);
  }

  const td = (text, cls) => h("td", cls ? { class: cls, text: text } : { text: text });
  const num = (value, percent) => td(fmt(value, percent), "num");
  const pre = (text, cls) => h("td", cls ? { class: cls } : {}, [h("pre", { text: text === null ? "" : text })]);
  const runCell = (row) => h("td", { class: "run" }, [h("span", { class: "chip", style: "background:" + color[row.run_id] }),
    document.createTextNode(row.run_id)]);

  function overview() {
    const columns = [["run", runCell], ["folder", (r) => td(r.run_dir)], ["mode", (r) => td(r.modes || "–")],
      ["steps", (r) => num(r.steps)], ["last step", (r) => num(r.last_step)], ["last loss", (r) => num(r.last_loss)],
      ["last reward", (r) => num(r.last_reward)], ["eval accuracy first → last", (r) => td(
        r.first_accuracy === null ? "–" : fmt(r.first_accuracy, true) + " → " + fmt(r.last_accuracy, true), "num")],
      ["tables with data", (r) => td(r.tables)]];
    return h("section", { id: "overview" }, [h("h2", { text: "Overview" })].concat(notes(data.notes),
      [table(columns, data.overview)]));
  }

  function samplesSection(section) {
    const node = h("section", { id: section.id }, [h("h2", { text: section.title })].concat(notes(section.notes)));
    if (!section.rows.length) {
      if (!section.notes.length) node.append(h("div", { class: "note", text: "No scored completions yet." }));
      return node;
    }
    const components = (c) => c ? Object.entries(c).map(([k, v]) => `${k}=${fmt(v)}`).join("\n") : "";
    const columns = [["step", (r) => num(r.step)], ["run", runCell], ["kind", (r) => td(r.kind, "kind-" + r.kind)],
      ["reward", (r) => num(r.reward)], ["components", (r) => pre(components(r.components))],
      ["tokens", (r) => td(`${r.n_completion_tokens} (${r.finish_reason || "?"})`, "num")],
      ["env / example", (r) => td(`${r.env} / ${r.example_id}`)], ["prompt", (r) => pre(r.prompt_text, "text")],
      ["completion", (r) => pre(r.completion_text, "text")]];
    const steps = [...new Set(section.rows.map((r) => r.step))].sort((a, b) => a - b);
    const select = h("select", {}, [h("option", { value: "", text: `all ${steps.length} steps` })]
      .concat(steps.map((v) => h("option", { value: String(v), text: "step " + v }))));
    const holder = h("div");
    const show = () => holder.replaceChildren(table(columns,
      section.rows.filter((r) => select.value === "" || String(r.step) === select.value)));
    select.addEventListener("change", show);
    show();
    node.append(h("div", { class: "controls" }, [document.createTextNode(
      "Best and worst scored completion of each step (samples_by_step.sql)."), select]), holder);
    return node;
  }

  function hardestSection(section) {
    const node = h("section", { id: section.id }, [h("h2", { text: section.title })].concat(notes(section.notes)));
    if (!section.rows.length) return node;
    const columns = [["run", runCell], ["rank", (r) => num(r.rank)], ["env / example", (r) => td(`${r.env} / ${r.example_id}`)],
      ["prompt", (r) => pre(r.prompt_text, "text")], ["mean reward", (r) => num(r.reward_mean)],
      ["samples", (r) => num(r.n_samples)], ["steps", (r) => td(`${r.n_steps} (${r.first_step}–${r.last_step})`, "num")]];
    node.append(h("details", {}, [h("summary", { text: `Lowest mean reward over the run (hardest_prompts.sql), ${section.rows.length} rows` }),
      table(columns, section.rows)]));
    return node;
  }

  function environmentsSection(section) {
    const node = h("section", { id: section.id }, [h("h2", { text: section.title })].concat(notes(section.notes)));
    const arrow = (a, b, percent) => td(a === null ? "–" : fmt(a, percent) + " → " + fmt(b, percent), "num");
    const columns = [["run", runCell], ["env", (r) => td(r.env)], ["steps", (r) => num(r.steps)],
      ["completions", (r) => num(r.n_samples)], ["trained", (r) => num(r.n_trained)],
      ["reward first → last step", (r) => arrow(r.first_reward, r.last_reward)],
      ["accuracy first → last step", (r) => arrow(r.first_accuracy, r.last_accuracy, true)],
      ["zero-variance groups", (r) => num(r.zero_variance_fraction, true)]];
    node.append(h("div", { class: "controls" }, [document.createTextNode(
      "Each environment of a mixture ([[task.envs]]), per run (env_by_step.sql; MLflow: rollout/<env>/*).")]),
      table(columns, section.rows));
    return node;
  }

  function plotSection(section) {
    const node = h("section", { id: section.id }, [h("h2", { text: section.title })].concat(notes(section.notes)));
    const big = section.plots.filter((p) => !p.small), small = section.plots.filter((p) => p.small);
    if (big.length) node.append(h("div", { class: "grid" }, big.map(drawPlot)));
    if (small.length) node.append(h("div", { class: "grid small" }, small.map(drawPlot)));
    return node;
  }

  function render() {
    // fate chart and rollout browser: report_rollouts.js, inlined before this script
    const rollouts = window.rlpipeRollouts(data, { h, s, fmt, ticks, notes, tip, showTip });
    const mixed = data.environments && data.environments.rows.length ? [data.environments] : [];
    const sections = [{ id: "overview", title: "Overview" }].concat(mixed, data.sections,
      [data.fates, data.rollouts, data.samples, data.hardest]);
    document.getElementById("top").append(
      h("h1", { text: data.title }),
      h("div", { class: "meta", text: `${data.runs.length} run folder(s) · generated ${data.generated_at}` +
        " · hover a plot for values · each plot names the canned query (rlpipe sql --query NAME) behind it" }),
      legend([...new Set(data.runs.map((run) => run.run_id))]),
      h("nav", {}, sections.map((sec) => h("a", { href: "#" + sec.id, text: sec.title }))));
    const main = document.getElementById("report");
    main.replaceChildren(overview(), ...mixed.map(environmentsSection), ...data.sections.map(plotSection), rollouts.fates, rollouts.rollouts,
      samplesSection(data.samples), hardestSection(data.hardest));
    document.documentElement.setAttribute("data-rlpipe-report", `ok:${count.plots}:${count.points}`);
  }

  try {
    render();
  } catch (error) {
    document.documentElement.setAttribute("data-rlpipe-report", "error:" + (error && error.stack || error));
    document.getElementById("report").prepend(h("div", { class: "note", text: "Report failed to render: " + error }));
  }
})();
