"""`pdserve serve --model DIR` refuses a malformed checkpoint with exit 2 and one `error:` line
naming the file and the problem, before any worker starts, and leaves no process behind.

Before: a missing or unreadable weights file, a garbage safetensors header or tokenizer ended in
the server's traceback (exit 1; a header length of 2**62 in a bare MemoryError); a truncated file,
a tensor of the wrong shape, a vocab_size or layer count the tensors do not have, or a context of
10**12 positions crashed every worker five times under --max-crashes (9-20 tracebacks, ~14 s);
a NaN rms_norm_eps, a negative rope_theta or an int8 dtype were served without complaint."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.model.config import load_config
from pdserve.model.tokenizer import load_tokenizer
from pdserve.ports import free_local_port
from tests.api.served_cli import ROOT
from tests.helpers.checkpoints import make_random_checkpoint, write_chat_tokenizer

pytestmark = pytest.mark.timeout(60)  # a check that regressed would start a cluster here
WEIGHTS = "model.safetensors"


def _config(**changes: object) -> Callable[[Path], None]:
    def edit(model_dir: Path) -> None:
        file = model_dir / "config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))  # NaN is written as NaN
    return edit


def _weights(change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(model_dir: Path) -> None:
        file = model_dir / WEIGHTS
        file.write_bytes(change(file.read_bytes()))
    return edit


def _no_weights(model_dir: Path) -> None:
    (model_dir / WEIGHTS).unlink()


def _weights_a_directory(model_dir: Path) -> None:
    (model_dir / WEIGHTS).unlink()
    (model_dir / WEIGHTS).mkdir()


def _garbage_header(data: bytes) -> bytes:
    length = int.from_bytes(data[:8], "little")
    return data[:8] + b"{" * length + data[8 + length:]


def _garbage_tokenizer(model_dir: Path) -> None:
    (model_dir / "tokenizer.json").write_text("{garbage")


# (case, edit of the good checkpoint, the file the line names, what it says)
CASES = [
    ("no weights", _no_weights, "", "no model.safetensors or model.safetensors.index.json found"),
    ("weights a directory", _weights_a_directory, WEIGHTS, "not a regular file"),
    ("garbage header", _weights(_garbage_header), WEIGHTS, "unreadable safetensors header"),
    ("header length 2**62", _weights(lambda d: (2**62).to_bytes(8, "little") + d[8:]), WEIGHTS,
     "its length field says 4611686018427387904 bytes"),
    ("truncated", _weights(lambda d: d[: len(d) // 2]), WEIGHTS, "truncated?"),
    ("garbage tokenizer", _garbage_tokenizer, "tokenizer.json", "unreadable tokenizer"),
    ("wrong shape", _config(hidden_size=96, head_dim=24), WEIGHTS,
     "tensor 'model.embed_tokens.weight' has shape (128, 64), expected (128, 96)"),
    ("vocab_size", _config(vocab_size=1000), WEIGHTS, "expected (1000, 64)"),
    ("num_hidden_layers", _config(num_hidden_layers=4), "", "missing tensor 'model.layers.2."),
    ("max_position_embeddings", _config(max_position_embeddings=10**12), "config.json",
     "max_position_embeddings must be at most"),
    ("rms_norm_eps NaN", _config(rms_norm_eps=float("nan")), "config.json",
     "rms_norm_eps must be a positive finite number, got nan"),
    ("rope_theta negative", _config(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "config.json",
     "rope_theta must be a positive finite number, got -1.0"),
    ("rope_theta zero", _config(rope_parameters=None, rope_theta=0), "config.json",
     "rope_theta must be a positive finite number, got 0"),
    ("dtype int8", _config(dtype="int8", torch_dtype="int8"), "config.json", "dtype 'int8' is not supported"),
]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_tokenizer(make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "good"), 128)


def test_the_good_checkpoint_passes_the_checks(good: Path) -> None:
    """The variants below differ from a checkpoint the pre-flight accepts in one edit each."""
    from pdserve.model.loader import check_checkpoint  # here, so the cases below also run on a tree without it

    assert len(check_checkpoint(good, load_config(good))) == 3 + 9 * 2  # embed, norm, lm_head; 9 a layer
    assert load_tokenizer(good) is not None


@pytest.mark.parametrize("case, edit, names, said", CASES, ids=[case[0] for case in CASES])
def test_a_malformed_checkpoint_is_refused_with_one_line_before_any_worker(
    good: Path, tmp_path: Path, case: str, edit: Callable[[Path], None], names: str, said: str,
) -> None:
    model_dir = tmp_path / "bad"
    shutil.copytree(good, model_dir)
    edit(model_dir)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model", str(model_dir),
                             "--port", str(free_local_port())], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)  # no crash loop: a refusal takes about the import time
        left_behind = _group_alive(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a regressed server's workers, ended here
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, (out, err)
    assert "Traceback" not in out + err and "pdserve worker" not in out + err, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(model_dir / names) in errors[0] and said in errors[0], err
    assert not left_behind, "a process of the refused server's group outlived it"


def _group_alive(pgid: int, grace_s: float = 2.0) -> bool:
    """Whether a process of group `pgid` is still there `grace_s` after its leader exited (an
    exiting child may take a moment to be reaped)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True
