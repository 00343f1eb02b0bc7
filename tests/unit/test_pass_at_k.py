"""Sampled evals (`eval.samples`): the unbiased pass@k estimator against hand-computed cases, maj@k,
and a short eval whose `evals` rows the canned query `pass_at_k_by_step` answers."""

from __future__ import annotations

import math
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlpipe.core import metric_names as m
from rlpipe.engines.base import Completion
from rlpipe.envs.arithmetic import ArithmeticConfig, ArithmeticEnv, format_answer
from rlpipe.storage.queries import run_canned, run_sql
from rlpipe.storage.writer import write_table
from rlpipe.tasks.config import RunConfig
from rlpipe.tasks.evaluate import EvalOptions, eval_metrics, eval_step
from rlpipe.tasks.pass_at_k import majority_correct, pass_at_k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (2, 1, 1, 0.5),        # one draw of two, one correct
    (4, 1, 2, 0.5),        # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),        # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 1, 0.3),       # pass@1 is the share correct
    (10, 3, 5, 11 / 12),   # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (3, 2, 2, 1.0),        # n - c < k: every draw of two holds a correct one
    (8, 0, 8, 0.0),
])
def test_pass_at_k_matches_hand_computed_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_stays_exact_where_the_binomials_are_huge():
    n, c, k = 200, 7, 100  # C(200, 100) has 59 digits
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("bad", [(3, 4, 1), (3, 1, 0), (3, 1, 4), (2, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(bad):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(*bad)


def test_majority_answer_decides_maj_at_k():
    assert majority_correct([("5", True), ("5", True), ("7", False)])
    assert not majority_correct([("7", False), ("7", False), ("5", True)])
    assert majority_correct([("5", True), ("7", False)])  # a tie goes to the smallest text
    assert not majority_correct([(None, True), (None, True)])  # no stated answer: no vote


class AlternatingEngine:
    """Greedy answers every prompt wrongly; sample i answers it correctly when i % period == 0."""

    def __init__(self, tokenizer, env, period):
        self.tokenizer, self.env, self.period = tokenizer, env, period
        self.answers = {tuple(tokenizer.encode(str(ex.prompt))): ex.answer for ex in env.examples("eval")}

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            value = self._answer(prompt)
            texts = ([str(value + 1)] if params.greedy else
                     [str(value) if i % self.period == 0 else str(value + 1 + i) for i in range(params.n)])
            ids = [self.tokenizer.encode(format_answer(int(t), False)) for t in texts]
            out.append([Completion(tokens, [0.0] * len(tokens), "stop") for tokens in ids])
        return out

    def _answer(self, prompt):
        text = self.tokenizer.decode(prompt, skip_special_tokens=True)
        return next(ex.answer for ex in self.env.examples("eval") if str(ex.prompt) in text)


def test_a_sampled_eval_writes_every_sample_and_the_query_answers_pass_at_k(tmp_path):
    from rlpipe.models.tokenizer import build_tokenizer

    env = ArithmeticEnv(ArithmeticConfig(max_digits=2, eval_size=6))
    tokenizer = build_tokenizer()
    examples = list(env.examples("eval"))
    engine = AlternatingEngine(tokenizer, env, period=2)  # samples 0 and 2 of 4 correct
    evals = eval_step(engine, tokenizer, env, examples, run_dir=tmp_path, run_id="r", step=3,
                      max_new_tokens=8, stop_token_ids=(), max_context=256, sampled=EvalOptions(4, 0.7))
    assert len(evals.rows) == 6 * (1 + 4)
    assert sorted({row["sample"] for row in evals.rows}, key=str) == [0, 1, 2, 3, None]
    metrics = evals.metrics
    assert metrics[m.EVAL_ACCURACY] == 0.0  # the greedy rows only
    assert [metrics[m.pass_at(k)] for k in (1, 2, 3, 4)] == pytest.approx([0.5, 5 / 6, 1.0, 1.0])
    assert metrics[m.maj_at(4)] == 1.0  # one correct answer twice against two wrong ones once each
    query = run_canned([tmp_path], "pass_at_k_by_step").to_pylist()
    assert [(row["step"], row["k"], row["prompts"], row["samples"]) for row in query] == [
        (3, k, 6, 4) for k in (1, 2, 3, 4)]
    assert [row["pass_at_k"] for row in query] == pytest.approx([metrics[m.pass_at(k)] for k in (1, 2, 3, 4)])
    assert [row["maj_at_k"] for row in query] == [None, None, None, 1.0]
    greedy = run_canned([tmp_path], "eval_by_step").to_pylist()
    assert [(row["n"], row["accuracy"]) for row in greedy] == [(6, 0.0)]


def test_runs_without_sampled_evals_still_read(tmp_path):
    """evals partitions written before `sample` and `answer` existed: greedy metrics as before, no
    pass@k rows, and the canned queries answer."""
    old = pa.table({"env": ["a", "a"], "example_id": ["1", "2"], "reward": pa.array([1.0, 0.0], pa.float32()),
                    "correct": [True, False]})
    write_table(tmp_path, "evals", 1, old, run_id="r")
    folder = tmp_path / "tables" / "evals"
    for path in [folder / "_schema.parquet", *folder.glob("step=1/*.parquet")]:  # as an older run wrote them
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(["sample", "answer"]).replace_schema_metadata(table.schema.metadata), path)
    assert "sample" not in run_sql([tmp_path], "select * from evals").column_names
    rows = [{"run_id": "r", "step": 1, **row} for row in old.to_pylist()]
    assert eval_metrics(rows) == {m.EVAL_ACCURACY: 0.5, m.EVAL_REWARD: 0.5}
    assert run_canned([tmp_path], "pass_at_k_by_step").num_rows == 0
    assert run_canned([tmp_path], "eval_by_step").to_pylist()[0]["accuracy"] == 0.5


def test_eval_config_defaults_to_the_greedy_eval_only():
    assert RunConfig().eval.samples == 0
    assert RunConfig(eval={"samples": 8, "temperature": 0.6}).eval.temperature == 0.6


def test_the_report_plots_pass_at_1_pass_at_k_and_maj_at_k_per_environment():
    from rlpipe.dashboards.report_plots import eval_plots

    rows = [{"run_id": "r", "step": step, "env": "arithmetic", "k": k, "prompts": 6, "samples": 4,
             "pass_at_k": 0.1 * step + 0.05 * k, "maj_at_k": 0.3 if k == 4 else None}
            for step in (0, 5) for k in (1, 2, 3, 4)]
    plots = {p["id"]: p for p in eval_plots({"eval_by_step": [], "pass_at_k_by_step": rows}, ["r"])}
    lines = {line["style"]: line for line in plots["pass_at_k_arithmetic"]["series"]}
    assert lines["solid"]["x"] == [0, 5] and lines["solid"]["y"] == pytest.approx([0.05, 0.55])
    assert lines["dashed"]["y"] == pytest.approx([0.2, 0.7]) and lines["dotted"]["y"] == [0.3, 0.3]
    assert "pass_at_k_arithmetic" not in {p["id"] for p in eval_plots({"eval_by_step": [], "pass_at_k_by_step": []}, ["r"])}
