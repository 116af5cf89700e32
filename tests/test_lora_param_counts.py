"""LoRA's parameter counts as peft states them: result.json's and train's line (the trainable share,
as print_trainable_parameters prints it), and flops' count of the same run."""

from __future__ import annotations

import json

from memtrain.cli import main


def _peft_counts(spec: str, r: int, targets: list[str]) -> tuple[int, int]:
    """peft's (trainable, all) parameters of ``spec`` with LoRA r on ``targets``."""
    # transformers and peft are optional extras: imported only by the tests that need them
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memtrain.models.auto_config import load_config

    model = AutoModelForCausalLM.from_config(load_config(spec))
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules=targets))
    return peft_model.get_nb_trainable_parameters()


def test_train_states_the_parameters_as_peft_counts_them(small_corpus, tmp_path, capsys, one_thread):
    """result.json's parameters + adapter_parameters is peft's "all params", and train prints it
    with the trainable share as print_trainable_parameters does."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-llama", "--data", str(small_corpus), "--lora-rank", "2",
                 "--lora-targets", "q_proj,v_proj", "--steps", "1", "--batch-size", "1", "--seq-len", "16",
                 "--val-blocks", "1", "--no-progress", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    trainable, total = _peft_counts("tiny-llama", 2, ["q_proj", "v_proj"])
    assert result["trainable_parameters"] == trainable
    assert result["parameters"] + result["adapter_parameters"] == total
    assert f"= {total:,}; trainable {trainable:,} ({100 * trainable / total:.4f}%)" in capsys.readouterr().out
    capsys.readouterr()
    assert main(["flops", "--model", "tiny-llama", "--lora-rank", "2", "--lora-targets", "q_proj,v_proj",
                 "--seq-len", "16", "--batch-size", "1", "--json"]) == 0
    flops = json.loads(capsys.readouterr().out)
    assert (flops["parameters"], flops["adapter_parameters"]) == (result["parameters"], result["adapter_parameters"])
