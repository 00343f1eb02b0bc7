"""SFT data from a mixture of sources (`[[sft.data]]`): files, folders and hub datasets, drawn in
proportion to their weights, the same for the same seed (what a resumed run's steps rely on)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.tasks.setup import mix, mixture_counts, sft_data, source_chats
from rlpipe.tasks.supervised_steps import step_indices
from rlpipe.training.config import SftSource, SupervisedConfig

from tests.hub_cache import tiny_hub_gsm8k, use_hub_cache


def test_mixture_counts_are_proportional_and_exact():
    assert mixture_counts([3, 1], 10) == [8, 2]
    assert mixture_counts([1, 1, 1], 10) == [4, 3, 3]
    assert mixture_counts([0.2, 0.8], 5) == [1, 4]


def test_mix_draws_by_weight_cycles_small_sources_and_is_seeded():
    small, large = [f"s{i}" for i in range(3)], [f"l{i}" for i in range(100)]
    drawn = mix([small, large], [1, 1], 20, seed=7)
    assert sum(x.startswith("s") for x in drawn) == 10 and sum(x.startswith("l") for x in drawn) == 10
    assert {x for x in drawn if x.startswith("s")} == set(small)  # 3 items, drawn 10 times: every pass
    assert len({x for x in drawn if x.startswith("l")}) == 10  # no repeats while a source lasts
    assert mix([small, large], [1, 1], 20, seed=7) == drawn
    assert mix([small, large], [1, 1], 20, seed=8) != drawn


@pytest.fixture
def sources(tmp_path, monkeypatch):
    use_hub_cache(monkeypatch, tmp_path / "hf")
    tiny_hub_gsm8k(tmp_path / "hf", train=10, test=2)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                        {"role": "assistant", "content": f"hello {i}"}]})
                               for i in range(4)) + "\n")
    pq.write_table(pa.Table.from_pylist([{"conv": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "a"}]}]),
                   tmp_path / "convs.parquet")
    return [SftSource(path="hf:openai/gsm8k:main", prompt_column="question", response_column="answer", weight=3,
                      system_prompt="Be brief."),
            SftSource(path=str(chats), weight=1),
            SftSource(path=str(tmp_path / "convs.parquet"), messages_column="conv", weight=1)]


def test_sources_read_as_chats(sources):
    gsm8k, jsonl, parquet = (source_chats(source) for source in sources)
    assert gsm8k[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="},
                        {"role": "assistant", "content": "1 plus 2 is 3.\n#### 3"}]
    assert len(gsm8k) == 10 and len(jsonl) == 4
    assert parquet == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    with pytest.raises(ValueError, match="row 0 has no column 'problem'"):
        source_chats(SftSource(path="hf:openai/gsm8k:main", prompt_column="problem", response_column="answer"))


def test_the_same_step_trains_on_the_same_examples_after_a_restart(sources):
    tokenizer = build_tokenizer()

    def build():
        return sft_data(None, tokenizer, n_examples=50, seed=3, max_len=256, sources=sources)

    first, again = build(), build()  # a resumed process rebuilds the list from the config
    assert len(first) == 50
    texts = [tokenizer.decode(seq.tokens) for seq in first]
    assert sum("####" in text for text in texts) == 30  # weight 3 of 5
    assert sum("hello" in text for text in texts) == 10 and sum("<|im_start|>user\nq" in text for text in texts) == 10
    for step in (1, 4, 9):
        chosen, _ = step_indices(len(first), 8, step, 3)
        assert [first[i].tokens for i in chosen] == [again[i].tokens for i in chosen]


def test_a_mixture_config_is_checked():
    with pytest.raises(ValidationError, match="data_path and data"):
        SupervisedConfig(data_path="x.jsonl", data=[{"path": "y.jsonl"}])
    with pytest.raises(ValidationError, match="prompt_column and response_column together"):
        SftSource(path="y.jsonl", prompt_column="q")
    with pytest.raises(ValidationError, match="weight"):
        SftSource(path="y.jsonl", weight=0)
    from rlpipe.tasks.config import RunConfig

    with pytest.raises(ValidationError, match="pretrain.data: a mixture of sources is for SFT"):
        RunConfig.model_validate({"pretrain": {"data": [{"path": "y.jsonl"}]}})
    assert RunConfig.model_validate({"sft": {"data": [{"path": "y.jsonl", "weight": 2}]}}).sft.data[0].weight == 2
