"""`rlpipe replay` refusals, before any model is loaded: they exit 2 and say why."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlpipe.flows.replay import main
from rlpipe.storage.writer import write_table
from rlpipe.tasks.config import validate_config
from rlpipe.tasks.replay_step import ReplayError, refuse_unsupported, start_weights


def run_dir_with(tmp_path, **rl):
    config = validate_config({"flow": "rl", "run_name": "r", "rl": {"steps": 3, **rl}})
    run = tmp_path / "run"
    (run / "tables").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    return run, config


def test_lora_and_unknown_steps_are_refused_with_the_reason(tmp_path, capsys):
    config = validate_config({"flow": "rl", "model": {"lora": {"rank": 4}}})
    with pytest.raises(ReplayError, match="model.lora"):
        refuse_unsupported(config)
    run, _ = run_dir_with(tmp_path)
    assert main([str(run), "--step", "9"]) == 2 and "outside the run's steps 1..3" in capsys.readouterr().err
    assert main([str(run), "--step", "2"]) == 2 and "step 1 was not trained" in capsys.readouterr().err
    write_table(run, "train_steps", 1, [{"mode": "rl", "loss": 0.5}])
    assert main([str(run), "--step", "1"]) == 2 and "step 1 has no train_tokens rows" in capsys.readouterr().err
    assert main([str(tmp_path), "--step", "1"]) == 2 and "no config.json" in capsys.readouterr().err


def test_the_starting_weights_come_from_the_flag_the_origin_or_the_config(tmp_path):
    run, config = run_dir_with(tmp_path)
    assert start_weights(run, config, None) == ""  # the seeded preset
    assert start_weights(run, config, "/ckpt") == "/ckpt"
    pipeline = validate_config({"flow": "pipeline", "run_name": "r"})
    with pytest.raises(ReplayError, match="--start SFT_CHECKPOINT"):
        start_weights(run, pipeline, None)
    origin = run / "tables" / "origins" / "step=0" / "part-0.parquet"  # as the lineage stage writes it
    origin.parent.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["r"], "step": [0], "parent_checkpoint": ["/sft/step_000040"]}), origin)
    assert start_weights(run, pipeline, None) == "/sft/step_000040"
