"""Bad input: a clear error that names the value, and nothing half-written on disk."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import tiny_model
from specrt.errors import InputError, ManifestError, UnknownSourceError
from specrt.export.pipeline import export_engines
from specrt.decoding.generate import Generator


def test_prompt_longer_than_engine(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])  # max_seq_len 64
    with pytest.raises(InputError, match=r"prompt of 64 tokens .* maximum sequence length 64"):
        gen.generate(prompt_ids=[1] * 64, method="autoregressive")


def test_generation_reaching_max_len_stops_cleanly(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    for method in ("autoregressive", "ngram"):
        out = gen.generate(prompt_ids=[1, 2, 3] * 20, max_new_tokens=50, method=method)
        assert out.stats["stop_reason"] == "max_seq_len"
        assert len(out.token_ids[0]) == 64 - 60
    # the next request on the same generator is unaffected
    assert len(gen.generate(prompt_ids=[1, 2], max_new_tokens=10, method="autoregressive").token_ids[0]) == 10


def test_export_caps_max_seq_len_at_the_models_positions(tmp_path):
    """A tiny model knows 256 positions: a request for 400 is capped (and said so), and a prompt past 256 is refused
    instead of generating at positions the model never saw."""
    tiny_model("llama", 0).save_pretrained(tmp_path / "src")
    said = []
    export_engines(str(tmp_path / "src"), tmp_path / "e", max_seq_len=400, log=said.append)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert manifest["models"]["target"]["max_seq_len"] == 256
    assert any("--max-seq-len 400" in s and "max_position_embeddings (256)" in s for s in said)
    from specrt.export.build import build
    build(tmp_path / "e", "onnxruntime", log=lambda *_: None)
    with pytest.raises(InputError, match="prompt of 300 tokens"):
        Generator.from_engines(tmp_path / "e").generate(prompt_ids=[1] * 300, method="autoregressive")


@pytest.mark.parametrize("kw, pattern", [
    (dict(temperature=-0.5), "temperature -0.5"),
    (dict(temperature=1.0, top_p=0.0), "top_p 0.0"),
    (dict(temperature=1.0, top_p=1.5), "top_p 1.5"),
    (dict(temperature=1.0, top_k=-1), "top_k -1"),
    (dict(method="beam"), "method 'beam'"),
    (dict(method="draft"), "no draft model"),
    (dict(max_new_tokens=0), "max_new_tokens 0"),
])
def test_invalid_parameters(tiny_engines, kw, pattern):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    with pytest.raises(InputError, match=pattern):
        gen.generate(prompt_ids=[1, 2], **kw)


def test_out_of_vocab_prompt_ids(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    with pytest.raises(InputError, match=r"\[999\]"):
        gen.generate(prompt_ids=[1, 999], method="autoregressive")


def test_unknown_source_leaves_nothing(tmp_path):
    out = tmp_path / "e"
    with pytest.raises(UnknownSourceError, match="'no-such-model'"):
        export_engines("no-such-model", out)
    assert list(tmp_path.iterdir()) == []


def test_failed_export_half_way_leaves_nothing(tmp_path):
    """The target graph is written, then the draft is refused (vocab differs): no engine directory remains."""
    tiny_model("llama").save_pretrained(tmp_path / "t")
    tiny_model("llama", vocab=48).save_pretrained(tmp_path / "d")
    with pytest.raises(ManifestError, match="vocab size 48.*has 64"):
        export_engines(str(tmp_path / "t"), tmp_path / "e", draft=str(tmp_path / "d"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t"]


def test_interrupted_export_leaves_nothing(tmp_path):
    tiny_model("llama", layers=6, hidden=128).save_pretrained(tmp_path / "t")
    # Ctrl-C as in a terminal: a process started in the background by a non-interactive shell (as CI runners may
    # start this suite) inherits SIGINT ignored, or blocked, and Python then never turns SIGINT into
    # KeyboardInterrupt (a blocked one stays pending and the export ends with 0).
    def as_in_a_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "export", "--target", str(tmp_path / "t"),
                             "--out", str(tmp_path / "e")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=as_in_a_terminal)
    deadline = time.time() + 120
    while not any(p.name.startswith(".e.partial") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.time() < deadline, "export ended before it could be interrupted"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    assert proc.returncode != 0, f"the export ran to its end after SIGINT: {proc.stderr.read().decode()[-2000:]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_an_interrupt_swallowed_mid_export_still_stops_it(tmp_path):
    """A KeyboardInterrupt raised inside a destructor is printed and dropped by Python; the staging directory
    still sees the Ctrl-C, removes itself and does not move into place."""
    from specrt.files import StagingDir
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with StagingDir(tmp_path / "e", force=False) as tmp:
                (tmp / "manifest.json").write_text("{}")
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass  # what happens to it in a __del__
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_force(tiny_engines):
    with pytest.raises(InputError, match="--force"):
        export_engines("smollm2-135m", tiny_engines["llama"][0])


def test_force_replaces_only_an_engine_set(tmp_path):
    """--force on a folder that is not an engine set (no manifest.json) or on a file is refused before anything is
    written, and the folder is left as it was; an engine set or an empty folder is replaced."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    for out in (mine, tmp_path / "file"):
        with pytest.raises(InputError, match=f"--out {out} is .*--force replaces only an engine set"):
            export_engines("smollm2-135m", out, force=True)
    assert (mine / "sub" / "notes.txt").read_text() == "keep me" and (tmp_path / "file").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]   # no staging directory either
    tiny_model("llama").save_pretrained(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "empty"):   # an empty folder, then the engine set written there
        export_engines(str(tmp_path / "src"), out, max_seq_len=16, force=True, log=lambda *_: None)
        assert (out / "manifest.json").is_file()


def test_manifest_mismatch(tiny_engines, tmp_path):
    import shutil
    src = tiny_engines["llama"][0]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with open(bad / "target.ort.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ManifestError, match="target.ort.onnx has sha256"):
        Generator.from_engines(bad)
    (bad / "target.ort.onnx").unlink()
    with pytest.raises(ManifestError, match="missing"):
        Generator.from_engines(bad)
    with pytest.raises(ManifestError, match="no manifest.json"):
        Generator.from_engines(tmp_path)


def test_draft_vocab_mismatch_refused(tiny_engines, tmp_path):
    import shutil
    bad = tmp_path / "pair"
    shutil.copytree(tiny_engines["llama"][0], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["models"]["draft"] = dict(manifest["models"]["target"], vocab_size=32)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="draft vocab size 32 differs from target vocab size 64"):
        Generator.from_engines(bad)


def test_cli_error_is_one_clear_line(tiny_engines):
    out = subprocess.run([sys.executable, "-m", "specrt.cli", "generate", str(tiny_engines["llama"][0]),
                          "--prompt-ids", "1,2", "--temperature", "-1"], capture_output=True, text=True)
    assert out.returncode != 0
    assert "temperature -1.0: must be >= 0" in out.stderr
    assert "Traceback" not in out.stderr
