"""What `dwdp serve` checks in the router process before any worker starts: the model directory,
its config and checkpoint, and the tokenizer. Each failure is one line naming the path and what
was expected, so a bad path costs a second, not a worker start-up and a traceback."""
from __future__ import annotations

from pathlib import Path

from dwdp.serve.config import ServeConfig


class PreflightError(ValueError):
    """A path `dwdp serve` cannot serve from; the message is one line."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_model_dir(path: str, dtype) -> None:
    """`path` is a directory with a config.json, a safetensors checkpoint and MoE experts dwdp wraps.

    Builds the model skeleton on the meta device and plans its keys against the checkpoint's
    headers (what every worker does next), so no weight is read here."""
    root = Path(path)
    if not root.exists():
        raise PreflightError(f"--model {path} does not exist: expected a checkpoint directory (config.json + "
                             "safetensors)")
    if not root.is_dir():
        raise PreflightError(f"--model {path} is a file: expected a checkpoint directory (config.json + safetensors)")
    if not (root / "config.json").is_file():
        raise PreflightError(f"--model {path} has no config.json: expected a checkpoint directory (config.json + "
                             "safetensors)")
    from dwdp.models.loading import CheckpointLoad

    try:
        CheckpointLoad(root, dtype).close()
    except (OSError, ValueError, KeyError) as exc:
        line = _first_line(exc)
        raise PreflightError(line if path in line else f"--model {path}: {line}") from None


def load_tokenizer(config: ServeConfig):
    """The tokenizer for text prompts: `config.tokenizer`, else the model directory's own if it has
    one, else None (token ids only). Nothing is downloaded; a --tokenizer that does not load is a
    PreflightError naming the path."""
    path = config.tokenizer or config.model
    if path is None:
        return None
    if config.tokenizer is not None and not Path(path).is_dir():
        what = "does not exist" if not Path(path).exists() else "is a file"
        raise PreflightError(f"--tokenizer {path} {what}: expected a tokenizer directory (tokenizer.json or "
                             "tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        if config.tokenizer is None:
            return None  # the model directory has no tokenizer: token ids only
        raise PreflightError(f"--tokenizer {path} does not load as a tokenizer ({_first_line(exc)}): expected a "
                             "tokenizer directory (tokenizer.json or tokenizer_config.json)") from None


def preflight(config: ServeConfig):
    """Check everything a worker would load from disk; returns the router's tokenizer (or None)."""
    if config.model is not None:
        from dwdp.runtime.devices import model_dtype

        check_model_dir(config.model, model_dtype(config.device, config.dtype))
    return load_tokenizer(config)
