"""A rotary embedding that turns a whole head of odd width cannot run: its cos/sin tables are one
channel wider than q and k, and transformers' first forward fails ("The size of tensor a (19) must
match the size of tensor b (20)"). transformers refuses such a config itself only for a family whose
config has a head_dim field (Llama, Mistral, Gemma) and a head wider than 4; the analytic estimate
read Llama and Mistral without it, and Qwen2, Phi-3 and GPT-NeoX reached the model, so estimate, plan
and maxbatch answered for a model train could not run. Every verb now refuses it in one line with
exit 2; GPT-2 (a learned position table) and a partial rotary embedding narrower than the head run."""

from __future__ import annotations

import json
import re

import pytest

from memtrain.cli import main
from memtrain.models import light_config
from memtrain.models.auto_config import HEAD_DIM_FAMILIES, load_config

transformers = pytest.importorskip("transformers")

WORDS = "rotary position embeddings need an even head dimension"
# hidden 152 / 8 heads: head_dim 19 (the smallest tables still build in a second)
ODD = {"hidden_size": 152, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 64,
       "num_hidden_layers": 1, "vocab_size": 384, "max_position_embeddings": 64}
FAMILIES = {
    "llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "phi3": {"pad_token_id": 0},
    # heads of 128 and 256 channels unless config.json says otherwise
    "qwen3": {"head_dim": 19}, "gemma": {"hidden_act": "gelu_pytorch_tanh", "head_dim": 19},
    "gpt_neox": {"rotary_pct": 1.0},
}
VERBS = {
    "estimate": ["estimate"], "trace": ["estimate", "--trace"], "plan": ["plan", "--budget", "1GiB"],
    "maxbatch": ["maxbatch", "--memory-budget", "1GiB"], "flops": ["flops"], "train": ["train", "--steps", "1"],
}


def _write(tmp_path, model_type: str, **fields) -> str:
    """A config.json written as a user writes one (JSON, no transformers class to validate it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **fields}))
    light_config._read_light_config.cache_clear()
    load_config.cache_clear()
    return str(path)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_refuses_an_odd_head_every_rotary_family_turns_whole(tmp_path, capsys, family, verb):
    spec = _write(tmp_path / "model", family, **ODD, **FAMILIES[family])
    out = tmp_path / "run"
    argv = VERBS[verb] + ["--model", spec, "--seq-len", "16", "--batch-size", "2"]
    assert main(argv + (["--out", str(out)] if verb == "train" else [])) == 2
    err = _one_error_line(capsys)
    if "head_dim" in FAMILIES[family]:
        assert WORDS in err and "head_dim = 19 (config.json's head_dim)" in err, err
    else:
        assert WORDS in err and "head_dim = 19 from hidden_size 152 / 8 heads" in err, err
        assert "e.g. hidden_size 160 for 8 heads" in err, err
    assert not out.exists() or not any(out.iterdir())  # refused before anything is written


def test_a_head_transformers_lets_through_is_refused_too(tmp_path, capsys):
    """transformers spares heads of 4 or fewer channels (its test fixtures): an odd one of 3 builds
    the config and fails the forward, as 19 does."""
    spec = _write(tmp_path, "llama", **{**ODD, "hidden_size": 24})
    assert transformers.AutoConfig.from_pretrained(spec).head_dim == 3  # transformers reads it
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    assert "head_dim = 3 from hidden_size 24 / 8 heads" in _one_error_line(capsys)


@pytest.mark.parametrize("family", ["gemma", "llama", "qwen2"])
def test_a_head_dim_set_in_the_config_is_named_as_what_to_change(tmp_path, capsys, family):
    spec = _write(tmp_path, family, **{**ODD, **FAMILIES[family], "hidden_size": 160, "head_dim": 19})
    assert main(["maxbatch", "--model", spec, "--seq-len", "16", "--memory-budget", "1GiB"]) == 2
    err = _one_error_line(capsys)
    assert "head_dim = 19 (config.json's head_dim); set an even head_dim in its config.json (e.g. 20)" in err, err


@pytest.mark.parametrize("family, fields", [("llama", {}), ("phi3", {"pad_token_id": 0}),
                                            ("gemma", {"head_dim": 19})])
def test_the_change_the_refusal_names_gives_a_model_that_runs(tmp_path, capsys, family, fields):
    """Each change the line proposes (a hidden size, a head_dim) is taken as given and the step is
    traced: the model is built and run under fake tensors."""
    spec = _write(tmp_path / "odd", family, **ODD, **fields)
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    err = _one_error_line(capsys)
    changes = [{"hidden_size": int(h)} for h in re.findall(r"e\.g\. hidden_size (\d+)", err)]
    changes += [{"head_dim": int(h)} for h in re.findall(r"even head_dim[^;]*?\(e\.g\. (\d+)\)", err)]
    assert changes, err
    for i, change in enumerate(changes):
        fixed = _write(tmp_path / f"fixed{i}", family, **{**ODD, **fields, **change})
        assert main(["estimate", "--trace", "--model", fixed, "--seq-len", "16", "--json"]) == 0, (change, capsys.readouterr().err)
        assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def test_gpt2_with_an_odd_head_keeps_working(tmp_path, capsys, small_text_corpus):
    """GPT-2 adds a learned position table: a head of 19 channels runs on every verb."""
    spec = _write(tmp_path / "model", "gpt2", n_embd=152, n_head=8, n_layer=1, n_positions=64, vocab_size=50257,
                  bos_token_id=50256, eos_token_id=50256)
    common = ["--model", spec, "--seq-len", "16", "--batch-size", "2"]
    for verb in ("estimate", "trace", "plan", "maxbatch", "flops"):
        assert main(VERBS[verb] + common) == 0, (verb, capsys.readouterr().err)
    out = tmp_path / "run"
    assert main(["train", *common, "--steps", "1", "--data", str(small_text_corpus), "--no-progress",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["steps"] == 1


@pytest.mark.parametrize("family, fields", [("phi3", {"pad_token_id": 0, "rope_parameters": {
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}), ("gpt_neox", {"rotary_pct": 0.5})])
def test_a_partial_rotary_embedding_narrower_than_an_odd_head_keeps_working(tmp_path, capsys, family, fields):
    """Phi-3's and GPT-NeoX's layers turn the first 10 channels of a 19-wide head (a 9-channel
    rotary width rounded up) and pass the rest: the model runs, and is estimated."""
    spec = _write(tmp_path, family, **ODD, **fields)
    assert main(["estimate", "--trace", "--model", spec, "--seq-len", "16", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def _head_width(family: str, **fields) -> int:
    """The width of one attention head in ``family``'s model (built on the meta device) of the
    config hidden 152, 8 heads and ``fields``: its query projection's outputs per head."""
    import torch

    config = transformers.AutoConfig.for_model(family, **{**ODD, "pad_token_id": 0, **fields})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    name, q = next((n, m) for n, m in model.named_modules() if n.endswith(("q_proj", "qkv_proj", "query_key_value")))
    fused = 1 if name.endswith("q_proj") else 3  # q, k and v in one Linear (8 k/v heads: as many as q)
    return q.out_features // (fused * 8)


@pytest.mark.parametrize("family", sorted(HEAD_DIM_FAMILIES))
def test_the_families_said_to_read_head_dim_take_it_from_the_config(family):
    """The line offers "set an even head_dim" only for a family whose attention takes config.json's
    head_dim; GPT-NeoX's heads are hidden_size / num_attention_heads wide whatever head_dim says."""
    assert _head_width(family, head_dim=20) == 20
    assert _head_width("gpt_neox", head_dim=20) == 19


# --- partial rotary widths -------------------------------------------------------------------------
# A family that slices q and k at its own rotary width (int(head_dim x partial_rotary_factor); GPT-J's
# rotary_dim) multiplies them by cos/sin tables 2 x ceil(width / 2) wide: an odd width fails the first
# forward ("The size of tensor a (5) must match the size of tensor b (6)"), whether the head is odd or
# even. Families that slice at the table's width (GPT-NeoX, Phi-3, GLM, Nemotron) run it.
SMALL = {"num_hidden_layers": 1, "vocab_size": 128, "intermediate_size": 32, "max_position_embeddings": 64,
         "num_key_value_heads": 4, "pad_token_id": 0}
PARTIAL_WIDTHS = {  # id: (model_type, config.json fields, whether transformers' forward fails)
    "stablelm-default-0.25-of-20": ("stablelm", {"hidden_size": 80, "num_attention_heads": 4}, True),
    "stablelm-0.5-of-20": ("stablelm", {"hidden_size": 80, "num_attention_heads": 4, "partial_rotary_factor": 0.5},
                           False),
    "stablelm-rope_parameters-0.25": ("stablelm", {"hidden_size": 80, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, True),
    "phi-default-0.5-of-19": ("phi", {"hidden_size": 76, "num_attention_heads": 4}, True),
    "phi-0.25-of-19": ("phi", {"hidden_size": 76, "num_attention_heads": 4, "partial_rotary_factor": 0.25}, False),
    "phi-head_dim-10": ("phi", {"hidden_size": 80, "num_attention_heads": 4, "head_dim": 10}, True),
    "persimmon-0.45-of-20": ("persimmon", {"hidden_size": 80, "num_attention_heads": 4,
                                           "partial_rotary_factor": 0.45}, True),
    "persimmon-default-0.5-of-20": ("persimmon", {"hidden_size": 80, "num_attention_heads": 4}, False),
    "gpt_neox_japanese-0.25-of-20": ("gpt_neox_japanese", {"hidden_size": 80, "num_attention_heads": 4,
                                                           "rotary_pct": 0.25}, True),
    "gpt_neox_japanese-0.5-of-20": ("gpt_neox_japanese", {"hidden_size": 80, "num_attention_heads": 4,
                                                          "rotary_pct": 0.5}, False),
    "gptj-5-of-20": ("gptj", {"n_embd": 80, "n_head": 4, "rotary_dim": 5}, True),
    "gptj-4-of-19": ("gptj", {"n_embd": 76, "n_head": 4, "rotary_dim": 4}, False),
    "gptj-0": ("gptj", {"n_embd": 80, "n_head": 4, "rotary_dim": 0}, True),
    "gptj-22-of-20": ("gptj", {"n_embd": 80, "n_head": 4, "rotary_dim": 22}, True),
    "codegen-5-of-20": ("codegen", {"n_embd": 80, "n_head": 4, "rotary_dim": 5}, True),
    "codegen-20-of-20": ("codegen", {"n_embd": 80, "n_head": 4, "rotary_dim": 20}, False),
    "gpt_neox-0.25-of-20": ("gpt_neox", {"hidden_size": 80, "num_attention_heads": 4, "rotary_pct": 0.25}, False),
    "phi3-0.45-of-20": ("phi3", {"hidden_size": 80, "num_attention_heads": 4, "partial_rotary_factor": 0.45},
                        False),
    "glm-0.5-of-19": ("glm", {"hidden_size": 80, "num_attention_heads": 4, "head_dim": 19,
                              "partial_rotary_factor": 0.5}, False),
    "nemotron-0.5-of-19": ("nemotron", {"hidden_size": 76, "num_attention_heads": 4,
                                        "partial_rotary_factor": 0.5}, False),
    "llama-rope_parameters-0.25": ("llama", {"hidden_size": 80, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, False),
    # a factor over 1 or below 0: no width of the head (tables wider than it, or none)
    "range-glm-1.5": ("glm", {"hidden_size": 80, "num_attention_heads": 4, "head_dim": 20,
                              "partial_rotary_factor": 1.5}, True),
    "range-phi3-1.5": ("phi3", {"hidden_size": 80, "num_attention_heads": 4, "partial_rotary_factor": 1.5}, True),
    "range-gpt_neox--0.5": ("gpt_neox", {"hidden_size": 80, "num_attention_heads": 4, "rotary_pct": -0.5}, True),
    "range-nemotron-1.5": ("nemotron", {"hidden_size": 80, "num_attention_heads": 4, "partial_rotary_factor": 1.5},
                           True),
    "range-stablelm-1.5": ("stablelm", {"hidden_size": 80, "num_attention_heads": 4, "partial_rotary_factor": 1.5},
                           True),
    "range-stablelm-0": ("stablelm", {"hidden_size": 80, "num_attention_heads": 4, "partial_rotary_factor": 0.0},
                         False),
    "range-llama-1.5": ("llama", {"hidden_size": 80, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.5}}, False),
}


def _forward_fails(model_type: str, fields: dict) -> bool:
    """Whether transformers' own model of the config fails to build, or to run one forward and
    backward on the CPU."""
    import torch

    config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **fields})
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (2, 8))
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
        model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("case", sorted(PARTIAL_WIDTHS))
def test_memtrain_refuses_exactly_the_partial_rotary_widths_transformers_cannot_run(tmp_path, capsys, case):
    model_type, fields, fails = PARTIAL_WIDTHS[case]
    assert _forward_fails(model_type, fields) is fails  # the table above, held to transformers itself
    spec = _write(tmp_path, model_type, **SMALL, **fields)
    code = main(["estimate", "--trace", "--model", spec, "--seq-len", "16", "--batch-size", "2", "--json"])
    if fails:
        assert code == 2
        err = _one_error_line(capsys)
        said = "from 0 to 1" if case.startswith("range-") else "even number"
        assert "rotary" in err and ("rotary_dim" in err or said in err), err
    else:
        assert code == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def test_the_refused_families_are_those_that_slice_at_their_own_width():
    """OWN_WIDTH_FAMILIES names the families whose crash the table above shows; each of them, and no
    family of the table that runs an odd width, slices q at a width it computes itself."""
    from memtrain.models.auto_config import OWN_WIDTH_FAMILIES, TABLE_WIDTH_FAMILIES

    crashing = {t for case, (t, f, fails) in PARTIAL_WIDTHS.items() if fails and not case.startswith("range-")}
    running_odd = {"gpt_neox", "phi3", "glm", "nemotron"}
    assert crashing == OWN_WIDTH_FAMILIES and not running_odd & OWN_WIDTH_FAMILIES
    assert running_odd <= TABLE_WIDTH_FAMILIES and not TABLE_WIDTH_FAMILIES & OWN_WIDTH_FAMILIES


PARTIAL_FIX = {  # model_type, config.json fields, the field the line names, its proposed value
    "stablelm": ({"hidden_size": 80, "num_attention_heads": 4}, "partial_rotary_factor", "0.3"),
    "phi": ({"hidden_size": 76, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        "rope_parameters.partial_rotary_factor", "0.526316"),
    "gpt_neox_japanese": ({"hidden_size": 80, "num_attention_heads": 4, "rotary_pct": 0.25}, "rotary_pct", "0.3"),
    "gptj": ({"n_embd": 80, "n_head": 4, "rotary_dim": 5}, "rotary_dim", "6"),
}


@pytest.mark.parametrize("family", sorted(PARTIAL_FIX))
def test_the_partial_width_refusal_names_the_field_and_a_value_that_runs(tmp_path, capsys, family):
    fields, field, value = PARTIAL_FIX[family]
    spec = _write(tmp_path / "odd", family, **SMALL, **fields)
    assert main(["maxbatch", "--model", spec, "--seq-len", "16", "--memory-budget", "1GiB"]) == 2
    err = _one_error_line(capsys)
    assert f"set {field} in its config.json to " in err and re.search(rf"to (an even number such as )?{value}\b", err), err
    if "." in field:
        holder, name = field.split(".")
        fixed_fields = {**fields, holder: {**fields[holder], name: float(value)}}
    else:
        fixed_fields = {**fields, field: json.loads(value)}
    fixed = _write(tmp_path / "fixed", family, **SMALL, **fixed_fields)
    assert not _forward_fails(family, fixed_fields)
    assert main(["estimate", "--trace", "--model", fixed, "--seq-len", "16", "--json"]) == 0, capsys.readouterr().err


PARTIAL_VERBS = {**VERBS, "bench": ["bench", "--scale", "quick"]}


@pytest.mark.parametrize("verb", sorted(PARTIAL_VERBS))
def test_every_verb_refuses_an_odd_partial_rotary_width(tmp_path, capsys, verb):
    spec = _write(tmp_path / "model", "stablelm", **SMALL, hidden_size=80, num_attention_heads=4)
    out = tmp_path / "run"
    argv = PARTIAL_VERBS[verb] + ["--model", spec]
    argv += [] if verb == "bench" else ["--seq-len", "16", "--batch-size", "2"]
    assert main(argv + (["--out", str(out)] if verb in ("train", "bench") else [])) == 2
    assert "= 5 channels of each head" in _one_error_line(capsys)
    assert not out.exists() or not any(out.iterdir())  # refused before anything is written


def test_generate_refuses_an_odd_partial_rotary_width(tmp_path, capsys):
    folder = tmp_path / "model"
    _write(folder, "stablelm", **SMALL, hidden_size=80, num_attention_heads=4)
    assert main(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    assert "partial_rotary_factor 0.25, the stablelm default) = 5 channels" in _one_error_line(capsys)


def test_export_refuses_a_checkpoint_whose_config_now_has_an_odd_partial_width(tmp_path, capsys, small_text_corpus):
    """A checkpoint trained with an even width, its config.json since edited to an odd one."""
    fields = {**SMALL, "hidden_size": 80, "num_attention_heads": 4, "vocab_size": 50257, "bos_token_id": 50256,
              "eos_token_id": 50256}
    spec = _write(tmp_path / "model", "stablelm", **fields, partial_rotary_factor=0.5)
    ckpt = tmp_path / "ck.pt"
    assert main(["train", "--model", spec, "--data", str(small_text_corpus), "--steps", "1", "--seq-len", "16",
                 "--batch-size", "2", "--no-progress", "--save", str(ckpt), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    _write(tmp_path / "model", "stablelm", **fields, partial_rotary_factor=0.25)
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 2
    assert "set partial_rotary_factor in its config.json to 0.3" in _one_error_line(capsys)
    assert not (tmp_path / "hf").exists()


# --- Falcon with ALiBi ---------------------------------------------------------------------------------
FALCON = {"hidden_size": 76, "num_attention_heads": 4, "num_kv_heads": 4, "new_decoder_architecture": True,
          "num_hidden_layers": 1, "vocab_size": 128}


def test_falcon_with_alibi_and_an_odd_head_is_refused_for_what_transformers_refuses(tmp_path, capsys):
    """ALiBi turns no channel and Falcon's layers run a 19-wide head (built here past the config
    check), yet transformers' rope check refuses every odd-headed Falcon config: the line says that,
    not that rotary embeddings need it."""
    import torch

    config = transformers.FalconConfig(**{**FALCON, "hidden_size": 80}, alibi=True)
    config.hidden_size = 76  # past the check: the model runs
    ids = torch.randint(1, 100, (1, 8))
    transformers.AutoModelForCausalLM.from_config(config)(input_ids=ids, labels=ids).loss.backward()
    spec = _write(tmp_path, "falcon", **FALCON, alibi=True)
    with pytest.raises(Exception, match="head_dim`=19"):
        transformers.AutoConfig.from_pretrained(spec)
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    err = _one_error_line(capsys)
    assert "transformers reads no Falcon config with an odd head dimension, even with alibi" in err, err
    assert "e.g. hidden_size 80 for 4 heads" in err and WORDS not in err, err


def test_falcon_with_alibi_and_a_head_transformers_reads_runs(tmp_path, capsys):
    """A 3-wide head passes transformers' check (heads of 4 or fewer): ALiBi Falcon runs it."""
    spec = _write(tmp_path, "falcon", **{**FALCON, "hidden_size": 12}, alibi=True)
    assert main(["estimate", "--trace", "--model", spec, "--seq-len", "16", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


# --- transformers' refusal, reworded only when recognised ---------------------------------------------
def _refusing(monkeypatch, exc: Exception) -> None:
    """transformers' AutoConfig made to fail reading any config with ``exc``."""
    def from_pretrained(cls, *args, **kwargs):
        raise exc

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(from_pretrained))


def _validation_error(cause: Exception) -> Exception:
    """What transformers raises for a config its class validator refuses: huggingface_hub's error,
    its cause the validator's own."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    try:
        raise StrictDataclassClassValidationError("validate_rope", cause) from cause
    except StrictDataclassClassValidationError as exc:
        return exc


@pytest.mark.parametrize("exc, reworded", [
    (_validation_error(ValueError("RoPE requires an even rotary dimension, but got `head_dim`=19 with ...")), True),
    (_validation_error(ValueError("rotary embeddings want an even width (head_dim=19)")), True),  # reworded text
    (_validation_error(ValueError("the rotary width of this head is odd")), False),  # no field: untouched
    (_validation_error(ValueError("RoPE requires an even rotary dimension, but got `head_dim`=20")), False),
    (KeyError("RoPE requires an even rotary dimension, but got `head_dim`=19"), False),  # not a validation error
])
def test_transformers_odd_head_refusal_is_reworded_only_when_recognised(tmp_path, capsys, monkeypatch, exc, reworded):
    spec = _write(tmp_path, "llama", **ODD)
    _refusing(monkeypatch, exc)
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    err = _one_error_line(capsys)
    if reworded:
        assert WORDS in err and "head_dim = 19 from hidden_size 152 / 8 heads" in err, err
    else:  # transformers' own words, whole
        shown = " ".join(str(exc).split())
        assert "cannot read the model config of --model" in err and shown in err and WORDS not in err, err


@pytest.mark.parametrize("fields, field", [
    ({"partial_rotary_factor": "abc"}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": "x"}},
     "rope_parameters.partial_rotary_factor"),
])
def test_a_partial_rotary_factor_that_is_no_number_is_refused_in_one_line(tmp_path, capsys, fields, field):
    """float() of it raised a ValueError with a traceback hint (exit 1)."""
    spec = _write(tmp_path, "stablelm", **SMALL, hidden_size=80, num_attention_heads=4, **fields)
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    assert f"its config.json's {field} is not a number; set it to a number from 0 to 1" in _one_error_line(capsys)
