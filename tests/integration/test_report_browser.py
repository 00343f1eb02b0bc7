"""The report of a tiny synthetic run renders in headless Chromium: no JavaScript error, every plot drawn,
the fate chart's totals right, and the rollout browser's filters showing the right rows.

The page's script sets `<html data-rlpipe-report="ok:<plots>:<points>">` when it finished, or
`error:<message>` (window.onerror); `--dump-dom` gives the DOM after the page's scripts ran.
The browser's filters are driven through the URL hash (`#rollouts?status=...&q=...`), which sets
the same state its controls do. Screenshots are left in the tests' tmp folders (report.png,
browser.png) for a human to look at.
"""

from __future__ import annotations

import collections
import html
import os
import re
import shutil
import subprocess
import urllib.parse

import pytest
from rlpipe.dashboards import report
from rlpipe.storage.queries import run_canned
from rlpipe.storage.writer import write_table

from tests.report_runs import write_fated_run
from tests.synthetic_runs import synthetic_step

STEPS = (0, 1, 2, 3, 4)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def _chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)
    if found is None:
        pytest.skip("chromium not installed: apt-get install -y chromium (.ci/run does)")
    return found


def _run(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def _write_run(run_dir, run_id: str, rl: bool) -> None:
    for step in STEPS:
        if rl:
            tables = synthetic_step(step, run_id=run_id, n_groups=6, group_size=4, n_token_rows=2, n_examples=8)
            for name, table in tables.items():
                write_table(run_dir, name, step, table, run_id=run_id, durable=False)
        write_table(run_dir, "train_steps", step, [dict(
            mode="rl" if rl else "sft", loss=2.0 / (step + 1) + (0 if rl else 0.3), grad_norm=1.0 + step % 2 + rl,
            lr=1e-4 * (1 + step if rl else 2), tokens=500, tokens_per_second=900.0 + (1 + rl) * step, seconds_generate=0.8 if rl else None, seconds_train=1.1,
            seconds_total=2.0)], run_id=run_id, durable=False)
        write_table(run_dir, "evals", step, [dict(env="arithmetic", example_id=str(i), reward=float(i % 2),
                                                   correct=(i + step) % 3 == 0) for i in range(6)],
                    run_id=run_id, durable=False)


@pytest.mark.browser
def test_report_renders_in_headless_chromium(tmp_path):
    chromium = _chromium()
    _write_run(tmp_path / "rl", "tiny/rl", rl=True)
    _write_run(tmp_path / "sft", "tiny/sft", rl=False)
    out = report.write_report([tmp_path / "rl", tmp_path / "sft"], tmp_path / "report.html")
    expected = [item["id"] for section in report.report_data([tmp_path / "rl", tmp_path / "sft"])["sections"]
                for item in section["plots"] if "series" in item]
    assert {"reward", "zero_variance", "attempts", "completion_length", "loss_sft", "loss_rl", "grad_norm_rl",
            "lr_sft", "train_tps_rl", "seconds_total_sft", "eval_arithmetic_sft", "eval_arithmetic_rl"} <= set(expected)

    done = _run(chromium, tmp_path, "--dump-dom", out.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    status = re.search(r'<html[^>]*\bdata-rlpipe-report="([^"]*)"', done.stdout)
    assert status, "the page's script never finished: " + done.stdout[:500]
    state = html.unescape(status.group(1))
    assert state.startswith("ok:"), state
    _, n_plots, n_points = state.split(":")
    drawn = {match.group(1): int(match.group(2)) for match in
             re.finditer(r'<svg class="plot"[^>]*data-plot-id="([^"]+)"[^>]*data-points="(\d+)"', done.stdout)}
    assert sorted(drawn) == sorted(expected) and int(n_plots) == len(expected)
    assert all(points > 0 for points in drawn.values()), drawn
    assert int(n_points) == sum(drawn.values())
    assert drawn["loss_sft"] == drawn["loss_rl"] == len(STEPS)  # one plot per phase, each on its own steps
    assert ">SFT step</text>" in done.stdout and ">RL step</text>" in done.stdout
    assert drawn["reward"] == len(STEPS)  # the SFT run has no scores
    assert done.stdout.count('class="kind-best"') == len(STEPS)  # one best sample per step
    assert "tiny/sft is an SFT run: it samples no completions" in done.stdout  # said once, at the top
    assert "has no rows in" not in done.stdout  # not again in every RL section

    shot = tmp_path / "report.png"
    done = _run(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", out.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def _dom(chromium: str, tmp_path, url: str) -> str:
    done = _run(chromium, tmp_path, "--dump-dom", url)
    assert done.returncode == 0, done.stderr[-2000:]
    status = re.search(r'<html[^>]*\bdata-rlpipe-report="([^"]*)"', done.stdout)
    assert status and html.unescape(status.group(1)).startswith("ok:"), done.stdout[:800]
    return done.stdout


def _visible(dom: str) -> list[str]:
    """The sample ids of the browser's rows on the page, top to bottom."""
    return [html.unescape(sid) for sid in re.findall(r'<tr data-row="\d+" data-sample-id="([^"]*)"', dom)]


def _matched(dom: str) -> int:
    return int(re.search(r'id="rollouts-summary" data-matched="(\d+)"', dom).group(1))


def _expected(rows, *, statuses=None, q="", reward=(None, None), tokens=(None, None), sort=None, desc=False,
              page=1, size=50):
    """What the browser should show: its filters and sort applied to the rollout_browser rows, in Python."""
    def within(value, bounds):
        lo, hi = bounds
        if lo is None and hi is None:
            return True
        return value is not None and (lo is None or value >= lo) and (hi is None or value <= hi)

    q = q.lower()
    kept = [(i, row) for i, row in enumerate(rows)
            if (statuses is None or row["status"] in statuses) and within(row["reward"], reward)
            and within(row["n_completion_tokens"], tokens)
            and (not q or q in (row["prompt_text"] or "").lower() or q in (row["completion_text"] or "").lower())]
    if sort:
        kept.sort(key=lambda item: (item[1][sort] is None, 0 if item[1][sort] is None
                                    else -item[1][sort] if desc else item[1][sort], item[0]))
    return [row["sample_id"] for _, row in kept], [row["sample_id"] for _, row in kept][(page - 1) * size:page * size]


@pytest.mark.browser
def test_fate_chart_and_rollout_browser_in_headless_chromium(tmp_path):
    """The fate chart's bars and totals equal the fates view; the browser's filters, sort, pages and detail work."""
    chromium = _chromium()
    run_dir = tmp_path / "rl"
    write_fated_run(run_dir, "tiny/rl", steps=(1, 2, 3, 4, 5), n_groups=8, group_size=6)
    out = report.write_report([run_dir], tmp_path / "report.html")
    rows = run_canned([run_dir], "rollout_browser").to_pylist()  # the browser's rows, in its default order
    fates = {(row["step"], row["status"]): row["n"] for row in run_canned([run_dir], "fates_by_step").to_pylist()}
    totals = collections.Counter()
    for (_, status), n in fates.items():
        totals[status] += n

    dom = _dom(chromium, tmp_path, out.as_uri())
    bars = collections.Counter()
    for status, step, n in re.findall(r'<rect x="[^"]*" width="[^"]*" y="[^"]*" height="[^"]*" fill="[^"]*" '
                                      r'data-status="([^"]+)" data-step="(\d+)" data-n="(\d+)"', dom):
        assert fates[(int(step), status)] == int(n)
        bars[status] += int(n)
    assert bars == totals and len(totals) >= 5
    assert re.search(rf'<svg class="fate-chart"[^>]*data-total="{len(rows)}"', dom)
    table = dom[dom.index('id="fate-totals"'):]
    shown_totals = dict(re.findall(r'<tr[^>]*data-status="([^"]+)">.*?data-n="(\d+)"', table[:table.index("</table>")]))
    assert {status: int(n) for status, n in shown_totals.items()} == dict(totals) | {"all": len(rows)}

    everything, first_page = _expected(rows)
    assert _matched(dom) == len(rows) == len(everything) and _visible(dom) == first_page
    assert 'data-page="1" data-pages="5"' in dom  # 240 completions, 50 a page

    def view(fragment: str, **filters) -> None:
        dom = _dom(chromium, tmp_path, out.as_uri() + "#rollouts?" + fragment)
        matched, page = _expected(rows, **filters)
        assert (_matched(dom), _visible(dom)) == (len(matched), page), fragment
        assert page, f"{fragment} shows nothing: a weak check"

    view("status=zero_variance", statuses={"zero_variance"})
    view("status=trained,stale,pending&q=ANSWER+1&sort=-reward&page=2",
         statuses={"trained", "stale", "pending"}, q="answer 1", sort="reward", desc=True, page=2)
    view("reward=0.5:1&tokens=:100&sort=n_completion_tokens&size=25".replace("n_completion_tokens", "tokens"),
         reward=(0.5, 1), tokens=(None, 100), sort="n_completion_tokens", size=25)
    view("q=Problem+3", q="problem 3")  # prompts are searched too
    view("q=" + urllib.parse.quote("</script>"), q="</script>")  # the nasty completion is found, not executed

    episode = next(row["sample_id"] for row in rows if row["n_turns"])
    dom = _dom(chromium, tmp_path, out.as_uri() + "#rollouts?open=" + urllib.parse.quote(episode))
    detail = dom[dom.index('id="rollout-detail"'):]
    fields = dict(re.findall(r'<dd data-field="([^"]+)">([^<]*)</dd>', detail))
    want = next(row for row in rows if row["sample_id"] == episode)
    assert html.unescape(fields["sample"]) == episode and fields["fate"] == want["status"]
    assert html.unescape(fields["reason"]) == want["reason"] and fields["turns"].startswith("2: 0.model 11 tok")
    assert re.findall(r'<div class="message role-(\w+)">', detail) == ["user", "assistant", "tool", "assistant"]

    shot = tmp_path / "browser.png"
    done = _run(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1400,4000",
                out.as_uri() + "#rollouts?status=trained&open=" + urllib.parse.quote(episode))
    assert done.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
