"""``k3-train export``, ``train --init-from`` and ``eval``/``sample --model``: a run's model
leaves as a hub folder with its tokenizer and comes back to evaluate, sample and train."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import cli_run, small_toml

from k3_model.hub import load_pretrained
from k3_trainer.cli import main
from k3_trainer.config import ConfigError
from k3_trainer.data import BytesCodec, HFCodec
from k3_trainer.hub import byte_tokenizer_json, folder_codec, folder_spec
from k3_trainer.session import TrainRequest, build_trainer, resolve

# eval --model reads the default recipe's batch shape (16 × min(128, max_seq_len)): the run
# uses the same, so both evaluations measure the same tokens.
CONFIG = small_toml(model={"max_seq_len": 32}, train=dict(
    batch_size=16, seq_len=32, eval_batches=2, warmup_steps=1, decay_steps=4))


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("hub")
    cli_run(root, data_dir, CONFIG, 3)
    assert main(["export", "--run-dir", str(root / "run"), "--out", str(root / "out")]) == 0
    return root


def _out(capsys, argv):
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_export_writes_the_weights_tokenizer_and_generation_config(run):
    out = run / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "configuration_kimi_k3.py", "generation_config.json",
        "model.safetensors", "modeling_kimi_k3.py", "tokenizer.json",
        "tokenizer_config.json"]  # the Kimi K3 form ships its modeling code and says how
    assert "pip install " in (out / "README.md").read_text()  # to install what it runs
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0xFF
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == \
        "<|endoftext|>"
    import tokenizers

    # the byte-level file, which encodes a text as it begins a document of the run
    shipped = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def main(): é"
    assert shipped.encode(text).ids == [0xFF, *text.encode()]  # the document start first
    assert shipped.encode(text, add_special_tokens=False).ids == list(text.encode())
    assert isinstance(folder_codec(out, folder_spec(out)), BytesCodec)
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == 0xFF
    assert config["model_type"] == "kimi_k3" and config["eos_token_id"] == 0xFF
    assert config["bos_token_id"] == 0xFF
    model = load_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["language_model.model.embed_tokens.weight"], model.embed.weight)
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_eval_and_sample_of_the_export_equal_those_of_the_run(run, data_dir, capsys):
    code, by_run, err = _out(capsys, ["eval", "--run-dir", str(run / "run")])
    assert code == 0, err
    code, by_model, err = _out(capsys, ["eval", "--model", str(run / "out"), "--data",
                                        str(data_dir), "--batches", "2"])
    assert code == 0, err
    assert by_run.split(": ", 1)[1] == by_model.split(": ", 1)[1]  # same loss, same tokens
    sampled = [_out(capsys, ["sample", flag, str(path), "--prompt", "def ", "--seed", "3",
                             "--max-new-tokens", "30"])[1]
               for flag, path in (("--run-dir", run / "run"), ("--model", run / "out"))]
    assert sampled[0] == sampled[1] and sampled[0].startswith("def ")


def test_bf16_export_keeps_the_decay_and_router_bias_in_fp32(run, tmp_path, capsys):
    code, out, err = _out(capsys, ["export", "--run-dir", str(run / "run"), "--out",
                                   str(tmp_path / "bf16"), "--dtype", "bf16"])
    assert code == 0, err and "bf16" in out
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    for name, tensor in tensors.items():
        fp32 = name.endswith(("A_log", "dt_bias", "e_score_correction_bias"))
        assert tensor.dtype == (torch.float32 if fp32 else torch.bfloat16), name


def test_export_refuses_to_replace_a_folder_unless_told(run, capsys):
    before = (run / "out" / "model.safetensors").read_bytes()
    code, _, err = _out(capsys, ["export", "--run-dir", str(run / "run"), "--out",
                                 str(run / "out")])
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1
    assert (run / "out" / "model.safetensors").read_bytes() == before


def test_init_from_starts_a_fresh_run_from_the_folders_weights(run, data_dir, tmp_path):
    resolved = resolve(
        TrainRequest(
            tmp_path / "cont",
            data=data_dir,
            init_from=run / "out",
            train_fields={"seq_len": 16, "batch_size": 2},
            model_fields={"kda_chunk_size": 16},
        )
    )
    assert resolved.init_from == run / "out" and resolved.resume_from is None
    assert resolved.model_config.kda_chunk_size == 16
    trainer = build_trainer(resolved, torch.device("cpu"), None, None)
    exported = load_pretrained(run / "out").state_dict()
    for name, value in trainer.model.state_dict().items():
        if name.endswith(("balancer.load", "balancer.updates")):
            assert not value.any()
        else:
            assert torch.equal(value, exported[name]), name
    assert trainer.state.step == 0


def test_init_from_records_the_folder_and_resumes_without_it(run, data_dir, tmp_path, capsys):
    target = tmp_path / "cont"
    code, _, err = _out(capsys, ["train", "--run-dir", str(target), "--data", str(data_dir),
                                 "--init-from", str(run / "out"), "--max-steps", "2",
                                 "--batch-size", "2", "--seq-len", "16", "--eval-batches",
                                 "1"])
    assert code == 0, err
    record = json.loads((target / "run.json").read_text())
    assert record["init_from"] == str((run / "out").resolve())
    assert record["sessions"][0]["init_from"] == record["init_from"]
    code, _, err = _out(capsys, ["train", "--run-dir", str(target), "--resume",
                                 "--init-from", str(run / "out"), "--max-steps", "3"])
    assert code == 0 and "is not read: the run's checkpoint holds its weights" in err


@pytest.mark.parametrize(("extra", "message"), [
    (["--n-layers", "8"], "n_layers=8 (it has 2) contradicts"),
    (["--preset", "small"], "--init-from"),
])
def test_init_from_refuses_flags_that_contradict_the_folder(run, data_dir, tmp_path, capsys,
                                                            extra, message):
    code, _, err = _out(capsys, ["train", "--run-dir", str(tmp_path / "x"), "--data",
                                 str(data_dir), "--init-from", str(run / "out"), *extra])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_init_from_refuses_data_of_another_tokenizer(run, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i} of a small corpus for a tokenizer\n\n"
                              for i in range(300)))
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "bpe"),
                 "--train-tokenizer", "260"]) == 0
    code, _, err = _out(capsys, ["train", "--run-dir", str(tmp_path / "x"), "--data",
                                 str(tmp_path / "bpe"), "--init-from", str(run / "out")])
    assert code == 2 and "is not the tokenizer" in err


def test_model_flags_need_what_they_read(run, tmp_path, capsys):
    code, _, err = _out(capsys, ["eval", "--model", str(run / "out")])
    assert code == 2 and "--model needs --data" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((run / "out" / name).read_bytes())
    code, _, err = _out(capsys, ["sample", "--model", str(bare)])
    assert code == 2 and "has no tokenizer.json" in err
    code, _, err = _out(capsys, ["eval", "--model", str(tmp_path / "none"), "--data", "x"])
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_the_byte_tokenizer_file_encodes_and_decodes_as_the_byte_codec():
    codec = HFCodec(byte_tokenizer_json(), "<|endoftext|>")
    texts = ["plain ascii", "héllo wörld ☃ 𝔘𝔫𝔦", "tabs\tand\nnewlines  ", ""]
    for text in texts:
        ours = BytesCodec().encode_batch([text])[0].tolist()
        assert codec.encode_batch([text])[0].tolist() == ours, text
        assert codec.decode(ours) == text
    assert codec.eod_id == 0xFF and codec.vocab_size == 256


def test_a_folders_eos_is_its_end_of_document_whatever_its_name(tmp_path):
    """A hub tokenizer's end-of-document token need not carry a name k3-train knows."""
    import tokenizers as tk

    from k3_trainer.hub import folder_codec
    from k3_trainer.models import get_model_spec

    tokenizer = tk.Tokenizer(tk.models.BPE(vocab={"a": 0, "b": 1, "[SEP]": 2}, merges=[]))
    tokenizer.add_special_tokens([tk.AddedToken("[SEP]", special=True)])
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    codec = folder_codec(tmp_path, get_model_spec("k3"))
    assert (codec.eod_id, getattr(codec, "eod_token", None)) == (2, "[SEP]")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    with pytest.raises(ConfigError, match=r"eos_token_id 7 is not in its tokenizer\.json"):
        folder_codec(tmp_path, get_model_spec("k3"))


def test_an_export_of_a_masked_run_says_so_and_eval_reads_it_masked(tmp_path, capsys):
    """A run trained with its documents apart is exported with ``document_masking`` in its
    config.json, and ``eval --model`` measures it as the run's own evaluation does."""
    from k3_trainer import prepare_dataset

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(800):  # short documents: every row of 32 tokens holds several
        (docs / f"{i:03d}.txt").write_text(f"item {i}: {i * 7 % 13} apples, {i % 5} pears\n")
    data = tmp_path / "data"
    prepare_dataset([str(docs)], data)
    (tmp_path / "c.toml").write_text(CONFIG)
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--data", str(data), "--config",
                 str(tmp_path / "c.toml"), "--max-steps", "3", "--document-masking"]) == 0
    out = tmp_path / "out"
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["document_masking"] is True
    code, by_run, err = _out(capsys, ["eval", "--run-dir", str(tmp_path / "run")])
    assert code == 0, err
    code, by_model, err = _out(capsys, ["eval", "--model", str(out), "--data", str(data),
                                        "--batches", "2"])
    assert code == 0, err
    assert by_run.split(": ", 1)[1] == by_model.split(": ", 1)[1]  # masked, as the run
    del config["document_masking"]
    (out / "config.json").write_text(json.dumps(config))
    code, unmasked, err = _out(capsys, ["eval", "--model", str(out), "--data", str(data),
                                        "--batches", "2"])
    assert code == 0 and unmasked.split(": ", 1)[1] != by_model.split(": ", 1)[1]
