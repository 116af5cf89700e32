"""--packing pad (TRL SFTTrainer's default, packing=False): one record per row, cut at --seq-len + 1
tokens and right-padded; pads are no targets (-100) and the losses average the real targets only.
The record boundaries are the tokenizing's own (stored in the cache entry), never searched for in
the stream; --packing concat (the default) keeps its ids, cache keys and losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from memtrain.cli import main
from memtrain.config.run import DataConfig, build_config
from memtrain.data import prepare_tokens
from memtrain.data.cache import cache_key, cache_root
from memtrain.data.loader import IGNORE_INDEX, RecordRows, make_train_loader, make_val_batches
from memtrain.data.tokenizer import EOT_ID, get_tokenizer

GPT = ["--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--max-seq-len", "64"]


def _records(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _texts() -> list[str]:
    """Records of 3 to about 60 tokens; every seventh one is far longer than a row of 16."""
    return [(f"Record {i}: " + " ".join(f"w{(i * 5 + j) % 23}" for j in range(2 + i % 9))
             + (" long tail" * 40 if i % 7 == 0 else "")) for i in range(80)]


def _splits(tmp_path: Path, data: Path, **kw):
    cfg = build_config({"data": str(data), "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.2, **kw})
    return prepare_tokens(cfg.data, progress=False), cfg


def _train_texts(texts: list[str], seed: int = 1234, fraction: float = 0.2) -> list[str]:
    """The records the document split sends to training (its draw: cache.assign_validation)."""
    is_val = np.random.default_rng(seed).random(len(texts)) < fraction
    return [t for t, v in zip(texts, is_val) if not v]


def test_the_offsets_frame_each_record_as_the_tokenizer_encoded_it(tmp_path):
    """Each stored offset pair holds exactly one record's GPT-2 ids and its eos, in order."""
    texts = _texts()
    data = _records(tmp_path / "r.jsonl", texts)
    splits, _ = _splits(tmp_path, data)
    gpt2 = get_tokenizer()
    expected = [gpt2.encode_ordinary(t) + [EOT_ID] for t in _train_texts(texts)]
    offsets = splits.train_offsets
    assert offsets is not None and len(offsets) == len(expected) + 1 == splits.n_train_docs + 1
    got = [np.asarray(splits.train[a:b]).tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert got == expected
    assert splits.val_offsets is not None and splits.val_offsets[-1] == len(splits.val)


def test_rows_are_the_records_truncated_and_padded_with_pads_ignored(tmp_path):
    """Row i of the training split is record i's ids cut at seq_len + 1; x pads with 0, y with -100;
    the truncated records are counted; the pad share counts the positions without a target."""
    texts = _texts()
    splits, _ = _splits(tmp_path, _records(tmp_path / "r.jsonl", texts))
    gpt2 = get_tokenizer()
    records = [gpt2.encode_ordinary(t) + [EOT_ID] for t in _train_texts(texts)]
    seq = 16
    rows = RecordRows(splits.train, seq, splits.train_offsets)
    assert len(rows) == len(records)
    x, y = rows.batch(list(range(len(records))))
    assert x.shape == y.shape == (len(records), seq)
    for i, ids in enumerate(records):
        row = ids[: seq + 1]
        n = len(row) - 1  # real targets of the row
        assert x[i, : len(row[:-1])].tolist() == row[:-1] and not x[i, n + (len(row) <= seq):].any()
        assert y[i, :n].tolist() == row[1:] and (y[i, n:] == IGNORE_INDEX).all()
    assert rows.n_truncated == sum(len(ids) > seq + 1 for ids in records) > 0
    real = sum(min(len(ids), seq + 1) - 1 for ids in records)
    assert rows.pad_fraction() == pytest.approx(1 - real / (len(records) * seq))
    xi, yi = rows[3]  # one item as the DataLoader's workers ask for it
    assert torch.equal(xi, x[3]) and torch.equal(yi, y[3])


def test_one_token_records_get_no_row_and_a_row_never_reads_past_its_record():
    """A record of its eos alone has nothing to predict (skipped, counted); the last record's row
    ends at the split's end."""
    tokens = np.array([5, 6, 7, 0, 9, 0, 0, 11, 12, 0], dtype=np.uint16)
    offsets = np.array([0, 4, 6, 7, 10])  # [5 6 7 eos] [9 eos] [eos] [11 12 eos]
    rows = RecordRows(tokens, 8, offsets)
    assert (len(rows), rows.n_skipped, rows.n_truncated) == (3, 1, 0)
    x, y = rows.batch([0, 1, 2])
    assert y.tolist() == [[6, 7, 0] + [-100] * 5, [0] + [-100] * 7, [12, 0] + [-100] * 6]
    assert x[2, :3].tolist() == [11, 12, 0] and not x[2, 3:].any()


def test_padding_never_changes_a_real_tokens_logits():
    """Why a right-padded row needs no attention mask and no position ids under a causal model:
    the logits of its real tokens equal those of the record alone, unpadded."""
    from memtrain.config.run import ModelConfig
    from memtrain.models.gpt import GPT as Model

    torch.manual_seed(0)
    model = Model(ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16)).eval()
    record = torch.tensor([[3, 9, 27, 5, 1]])
    padded = torch.cat([record, torch.zeros(1, 11, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(padded)[:, :5], model(record), atol=1e-6)


def test_losses_average_the_real_targets_only(tmp_path):
    """The model's loss on padded rows and the validation loss over batches of different real
    counts equal the mean cross-entropy over the real targets, computed by hand from the logits;
    every micro-batch of a pad loader is counted for the accumulated mean."""
    from memtrain.config.run import ModelConfig
    from memtrain.data.device_feed import DeviceFeed
    from memtrain.models.gpt import GPT as Model
    from memtrain.techniques import make_precision
    from memtrain.training.train import evaluate

    splits, _ = _splits(tmp_path, _records(tmp_path / "r.jsonl", _texts()))
    torch.manual_seed(0)
    model = Model(ModelConfig(vocab_size=50257, d_model=32, n_heads=4, n_layers=1, d_ff=64, max_seq_len=16)).eval()
    batches = make_val_batches(splits.train, 16, 7, 3, offsets=splits.train_offsets)  # 3 + 3 + 1 rows
    assert [len(x) for x, _ in batches] == [3, 3, 1]
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            ce = F.cross_entropy(model(x).reshape(-1, 50257).double(), y.reshape(-1), ignore_index=-100,
                                 reduction="sum")
            total, count = total + float(ce), count + int((y != -100).sum())
            real = y != -100
            assert 0 < int(real.sum())
            hand = F.cross_entropy(model(x)[real].double(), y[real])
            assert float(model(x, y)) == pytest.approx(float(hand), rel=1e-5)
    assert count < sum(y.numel() for _, y in batches)  # some targets are pads
    got = evaluate(model, batches, make_precision("fp32", torch.device("cpu")), torch.device("cpu"))
    assert got == pytest.approx(total / count, rel=1e-5)
    feed = DeviceFeed(make_train_loader(splits.train, 16, 2, seed=1, offsets=splits.train_offsets), torch.device("cpu"))
    group = feed.next_group(2)
    assert group.target_counts == [int((y != -100).sum()) for _, y in group]


def test_loss_on_completion_and_pad_combine(tmp_path):
    """--loss-on completion's prompts and the pads are both -100 in a row's targets."""
    pairs = [(f"Question {i}: how do I sort a list?", f" Use sorted(x{i}).") for i in range(40)]
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    splits, _ = _splits(tmp_path, data, data_format="prompt-completion", loss_on="completion")
    gpt2 = get_tokenizer()
    prompt = _train_texts([p for p, _ in pairs])[0]  # the first training record's
    first = next(pc for pc in pairs if pc[0] == prompt)
    n_prompt, ids = len(gpt2.encode_ordinary(first[0])), gpt2.encode_ordinary(first[0] + first[1]) + [EOT_ID]
    x, y = RecordRows(splits.train, 32, splits.train_offsets, splits.train_mask).batch([0])
    want = [t if i + 1 >= n_prompt else -100 for i, t in enumerate(ids[1:])] + [-100] * (32 - len(ids) + 1)
    assert y[0].tolist() == want and x[0, : len(ids)].tolist() == ids
    # result.json's pad share counts pads only: the prompts' -100 are no padding
    from memtrain.training.train import padding_fields

    rows = RecordRows(splits.train, 32, splits.train_offsets, splits.train_mask)
    val = make_val_batches(splits.val, 32, 4, 2, mask=splits.val_mask, offsets=splits.val_offsets)
    got = padding_fields(rows, splits.val, splits.val_offsets, val, 100.0)
    plain = RecordRows(splits.val, 32, splits.val_offsets)
    assert got["padding"]["val_pad_fraction"] == pytest.approx(plain.pad_fraction(4))
    assert got["padding"]["val_targets_evaluated"] == sum(int((y != -100).sum()) for _, y in val)
    assert got["pad_fraction"] == pytest.approx(RecordRows(splits.train, 32, splits.train_offsets).pad_fraction())


def test_concat_keeps_its_cache_key_and_pad_shares_the_entry():
    """The key of a concat run is the one it had before --packing (pinned on the commit before it);
    --packing is not in the key: both packings read the same ids."""
    assert cache_key(DataConfig()) == "be426f2352bb900b08714cb0305d6a6805aa5aa8cbdeb4de677e1782085ef5e7"
    assert cache_key(DataConfig(data="default", max_documents=50, val_fraction=0.1)) == \
        "ce3f15af1de0f157eb727b8e966522fad6e959cd129dc500a4c877d29d454554"
    assert cache_key(DataConfig(packing="pad")) == cache_key(DataConfig())


def test_an_entry_without_offsets_serves_concat_and_is_rebuilt_for_pad(tmp_path):
    """An entry written before the offsets were stored (no .idx, no record_offsets in meta.json):
    concat reads it as it is; pad tokenizes again and replaces it with the same ids. Damaged
    offsets rebuild the entry, never crash the loader."""
    data = _records(tmp_path / "r.jsonl", _texts())
    splits, cfg = _splits(tmp_path, data)
    entry = Path(splits.cache_path)
    ids = np.asarray(splits.train).copy()
    meta = json.loads((entry / "meta.json").read_text())
    del meta["record_offsets"]
    (entry / "meta.json").write_text(json.dumps(meta))
    for s in ("train", "val"):
        (entry / f"{s}.idx").unlink()
    old, _ = _splits(tmp_path, data)
    assert old.from_cache and old.train_offsets is None and not (entry / "train.idx").exists()
    new, _ = _splits(tmp_path, data, packing="pad")
    assert not new.from_cache and new.train_offsets is not None and np.array_equal(np.asarray(new.train), ids)
    assert (entry / "train.idx").exists()
    (entry / "train.idx").write_bytes(np.array([0, 5, 3] + [0] * (new.n_train_docs - 2), np.int64).tobytes())
    again, _ = _splits(tmp_path, data, packing="pad")
    assert not again.from_cache and np.array_equal(again.train_offsets, new.train_offsets)
    assert cache_root(cfg.data) == entry.parent


def test_train_pad_says_what_it_cut_and_reports_the_padding(tmp_path, capsys):
    """A pad run: one stderr line counts the truncated records; result.json adds pad_fraction,
    real_tokens_per_s and padding, and its losses are finite."""
    data = _records(tmp_path / "r.jsonl", _texts())
    out = tmp_path / "run"
    run = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--val-blocks", "4", "--val-fraction", "0.2",
           "--no-progress", "--cache-dir", str(tmp_path / "cache"), *GPT]
    assert main(["train", "--data", str(data), "--packing", "pad", *run, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    n_train = len(_train_texts(_texts()))
    lines = [ln for ln in captured.err.splitlines() if "--packing pad" in ln]
    assert len(lines) == 1 and f"of {n_train} training records are longer than a row" in lines[0]
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["data"]["packing"] == "pad"
    assert 0 < result["pad_fraction"] < 1 and result["padding"]["train_rows"] == n_train
    gpt2 = get_tokenizer()
    longer = sum(len(gpt2.encode_ordinary(t)) + 1 > 17 for t in _train_texts(_texts()))
    assert result["padding"]["truncated_records"] == longer and f"{longer:,} of" in lines[0]
    assert result["real_tokens_per_s"] == pytest.approx(result["tokens_per_s"] * (1 - result["pad_fraction"]))
    assert 0 < result["padding"]["val_targets_evaluated"] < result["data"]["val_tokens_evaluated"]
    assert f"on the {result['padding']['val_targets_evaluated']:,} real targets" in captured.out
    assert all(np.isfinite(result["loss_history"]))
    plain = tmp_path / "plain"
    assert main(["train", "--data", str(data), *run, "--out", str(plain)]) == 0
    concat = json.loads((plain / "result.json").read_text())
    assert concat["pad_fraction"] == 0.0 and "padding" not in concat


def test_bad_packing_and_data_without_rows_are_one_line(tmp_path, capsys):
    """A typo, an empty file and a batch larger than the records are refused in one line, exit 2,
    before --out is made."""
    one = _records(tmp_path / "few.jsonl", [f"record {i} text" for i in range(6)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for args, said in ((["--data", str(one), "--packing", "padded"], "unknown --packing 'padded'"),
                       (["--data", str(empty), "--packing", "pad"], "is empty"),
                       (["--data", str(one), "--packing", "pad", "--batch-size", "64", "--val-fraction", "0.3"],
                        "--packing pad: the training split has")):
        out = tmp_path / "never"
        assert main(["train", *args, *GPT, "--steps", "1", "--no-progress", "--cache-dir", str(tmp_path / "c"),
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error:") and said in err, err
        assert not out.exists()


def test_resume_refuses_another_packing(tmp_path, capsys):
    """A checkpoint of a pad run resumed with --packing concat is another run: refused, naming it."""
    data = _records(tmp_path / "r.jsonl", _texts())
    run = ["--data", str(data), "--seq-len", "16", "--batch-size", "2", "--val-blocks", "2", "--val-fraction", "0.2",
           "--no-progress", "--cache-dir", str(tmp_path / "cache"), *GPT]
    ckpt = tmp_path / "ckpt.pt"
    assert main(["train", *run, "--packing", "pad", "--steps", "2", "--stop-after", "1", "--save", str(ckpt),
                 "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main(["train", *run, "--packing", "concat", "--steps", "2", "--resume", str(ckpt),
                 "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "packing" in err
    shutil.rmtree(tmp_path / "b", ignore_errors=True)
    assert main(["train", "--resume", str(ckpt), "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "c" / "result.json").read_text())["config"]["data"]["packing"] == "pad"


def test_a_template_that_writes_eos_inside_a_record_still_gives_one_row_per_record(tmp_path):
    """A Llama-2-like template closes every answer with eos, so a record of two answers holds an eos
    inside it: the rows follow the tokenizing's boundaries (one per conversation), not the eos ids."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    # test_chat_data skips itself at import without transformers: imported once the skips above passed
    from test_chat_data import CONVERSATIONS, LLAMA2, _chat_folder, _expected, _split_of, _tokens

    model = _chat_folder(tmp_path / "llama", LLAMA2, family="llama")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    splits, tok = _tokens(tmp_path, data, model, data_format="chat", packing="pad")
    eos = tok.eot_id
    in_val = _split_of(len(CONVERSATIONS))
    assert np.asarray(splits.train).tolist() == _expected(tok.tok, in_val, eos, val=False)
    rows = RecordRows(splits.train, 512, splits.train_offsets)
    assert len(rows) == in_val.count(False) < int((np.asarray(splits.train) == eos).sum())
    x, y = rows.batch([0])
    only_first = [i != in_val.index(False) for i in range(len(CONVERSATIONS))]  # the first training record alone
    first = _expected(tok.tok, only_first, eos, val=False)
    assert x[0, : len(first) - 1].tolist() == first[:-1] and int((y[0] != -100).sum()) == len(first) - 1


def test_estimate_sizes_a_pad_step_as_a_concat_one_and_the_trainer_comparison_refuses_pad(capsys):
    """estimate takes --packing (a train command's flags fit) and answers the same bytes: the step is
    batch x seq_len either way. bench's Trainer side packs as run_clm does: pad is no equivalent."""
    from memtrain.bench.hf.mapping import hf_plan

    small = ["--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--seq-len", "32", "--batch-size", "2", "--json"]
    answers = []
    for packing in ("concat", "pad"):
        assert main(["estimate", "--packing", packing, *small]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0]["bytes"] == answers[1]["bytes"] and answers[0]["peak_bytes"] == answers[1]["peak_bytes"]
    plan = hf_plan(build_config({"packing": "pad"}), "cpu")
    assert plan.status == "none" and any("--packing pad" in m for m in plan.missing)
    assert not any("--packing" in m for m in hf_plan(build_config({}), "cpu").missing)


def test_the_bench_report_says_tokens_per_s_counts_the_pads():
    """A report with a padded row says what Tokens/s counts and each row's real rate; none without."""
    from memtrain.report.tables import padding_lines

    pad = {"status": "ok", "technique": "baseline", "pad_fraction": 0.525, "real_tokens_per_s": 30.1}
    concat = {"status": "ok", "technique": "bf16", "pad_fraction": 0.0, "real_tokens_per_s": 67.0}
    lines = padding_lines([pad, concat])
    assert "baseline: 52.5% padding, 30 real tokens/s" in lines[0] and "bf16" not in lines[0]
    assert padding_lines([concat, {"status": "ok", "technique": "old row"}]) == []


def test_the_truncation_line_names_each_split_and_says_the_row_once():
    """truncation_line of record rows built from offsets: a split with nothing cut or skipped is
    not mentioned, the row's length is said in the first part that cuts, and skipped validation
    records are said to be validation records."""
    from memtrain.training.train import truncation_line

    tokens = np.arange(100) % 50
    short = RecordRows(tokens, 8, np.array([0, 5, 9, 14]))            # records of 5, 4, 5: none cut
    cut = RecordRows(tokens, 8, np.array([0, 20, 21, 26, 40]))         # 20 (cut), 1 (skipped), 5, 14 (cut)
    assert truncation_line(short, short, 3) is None
    line = truncation_line(short, cut, 2)
    assert line == ("note: --packing pad: 2 of 4 validation records are longer than a row (--seq-len + 1 = 9 "
                    "tokens) and were truncated (1 of the 2 rows val_loss is read on); 1 validation record held "
                    "a single token (nothing to predict) and was skipped (raise --seq-len to keep more)")
    both = truncation_line(cut, cut, 3)
    assert both is not None and both.count("--seq-len + 1") == 1 and "2 of 4 training records" in both
    assert "(2 of the 3 rows val_loss is read on)" in both
    assert truncation_line(cut) is not None and "validation" not in truncation_line(cut)


@pytest.mark.slow
def test_pad_losses_hold_under_grad_accum_and_loader_workers(tmp_path):
    """--packing pad's rows hold different numbers of real targets, so a step of two micro-batches
    must weight each by its share of the step's targets (not 1/2) to train as one batch of both:
    batch 2 x --grad-accum 2 gives batch 4's losses, and a loader worker process
    (--num-workers 1) gives the same batches, so the same losses, as the main process."""
    data = _records(tmp_path / "r.jsonl", _texts())
    common = ["--data", str(data), "--packing", "pad", "--steps", "4", "--seq-len", "16", "--val-blocks", "4",
              "--val-fraction", "0.2", "--no-progress", "--lr", "1e-2", "--warmup-steps", "1",
              "--dropout", "0", "--cache-dir", str(tmp_path / "cache"), *GPT]  # no dropout: no draw differs

    def losses(name: str, *extra: str) -> tuple[list[float], float]:
        assert main(["train", *common, *extra, "--out", str(tmp_path / name)]) == 0
        result = json.loads((tmp_path / name / "result.json").read_text())
        return result["loss_history"], result["val_loss"]

    whole, whole_val = losses("whole", "--batch-size", "4")
    accum, accum_val = losses("accum", "--batch-size", "2", "--grad-accum", "2")
    worker, worker_val = losses("worker", "--batch-size", "4", "--num-workers", "1")
    assert len(whole) == 4 and len(set(whole)) > 1  # steps that trained: the losses move
    assert accum == pytest.approx(whole, rel=1e-5) and accum_val == pytest.approx(whole_val, rel=1e-5)
    assert worker == whole and worker_val == whole_val
