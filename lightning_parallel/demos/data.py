"""Byte-level language-modelling data: a text corpus that needs no download, and seeded random tokens.

The default corpus is the Python standard library's own ``.py`` source, which exists on every machine that runs
Python. Every dataset yields ``(inputs, targets)`` pairs of long tensors of shape ``(seq_len,)`` where ``targets`` is
``inputs`` shifted by one token.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset
from typing_extensions import override

__all__ = [
    "RandomTokenDataModule",
    "RandomTokenDataset",
    "TextDataModule",
    "TokenChunkDataset",
    "default_corpus_files",
    "load_corpus",
]

PathLike = str | Path
_TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})
_EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__"})
_BINARY_SNIFF_BYTES = 8192


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without ``site-packages`` and test directories.

    Returns:
        Paths under ``sysconfig.get_paths()["stdlib"]``; empty if this Python ships its standard library zipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into site-packages or the (large) test suites.
        dirnames[:] = [d for d in dirnames if not _is_excluded_dir(d)]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files)


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIR_NAMES or name in _TEST_DIR_NAMES or name.startswith("test_")


def _is_text_file(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" not in f.read(_BINARY_SNIFF_BYTES)


def _files_in_directory(directory: Path) -> list[Path]:
    """All text files below ``directory``, sorted, skipping hidden entries and ``__pycache__``."""
    files = []
    for path in directory.rglob("*"):
        parts = path.relative_to(directory).parts
        if any(p.startswith(".") or p == "__pycache__" for p in parts) or not path.is_file():
            continue
        if _is_text_file(path):
            files.append(path)
    return sorted(files)


def _resolve_files(path: PathLike | Sequence[PathLike] | None) -> list[Path]:
    if path is None:
        files = default_corpus_files()
        if not files:
            stdlib = sysconfig.get_paths()["stdlib"]
            raise FileNotFoundError(f"No `.py` files found in the standard library at {stdlib!r}; pass a `path`.")
        return files
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise ValueError("`path` is an empty list; pass at least one file or directory, or None for the default.")
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = _files_in_directory(p)
            if not found:
                raise ValueError(f"The corpus directory {str(p)!r} contains no text files.")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"The corpus path {str(p)!r} does not exist.")
    return files


def load_corpus(path: PathLike | Sequence[PathLike] | None = None, max_bytes: int | None = None) -> Tensor:
    """Read text files as one stream of byte tokens.

    Args:
        path: A file, a directory (all text files below it, sorted by path), a list of those, or ``None`` for the
            standard library's source (:func:`default_corpus_files`).
        max_bytes: Stop after this many bytes (files are read in order); ``None`` reads everything.

    Returns:
        A 1-D long tensor of byte values in ``[0, 256)``, the files concatenated in order.

    Raises:
        FileNotFoundError: If a path does not exist.
        ValueError: If ``max_bytes`` is not positive or the corpus is empty.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"`max_bytes={max_bytes}` must be a positive number of bytes, or None for no limit.")
    files = _resolve_files(path)
    buffer = bytearray()
    for file in files:
        buffer += file.read_bytes()
        if max_bytes is not None and len(buffer) >= max_bytes:
            del buffer[max_bytes:]
            break
    if not buffer:
        raise ValueError(f"The corpus {[str(f) for f in files]!r} is empty; pass files that contain text.")
    return torch.frombuffer(buffer, dtype=torch.uint8).long()


class TokenChunkDataset(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping chunks of ``seq_len + 1`` tokens, as ``(chunk[:-1], chunk[1:])`` pairs.

    Args:
        tokens: 1-D tensor of token ids; a trailing remainder shorter than one chunk is dropped.
        seq_len: Length of each input (and target) sequence.
    """

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"`seq_len={seq_len}` must be positive.")
        if tokens.dim() != 1:
            raise ValueError(f"`tokens` must be 1-D, got shape {tuple(tokens.shape)}.")
        num_chunks = tokens.numel() // (seq_len + 1)
        if num_chunks == 0:
            raise ValueError(
                f"The corpus has {tokens.numel()} tokens, fewer than one chunk of `seq_len + 1 = {seq_len + 1}`; "
                "use a larger corpus or a smaller `seq_len`."
            )
        self.seq_len = seq_len
        self.chunks = tokens[: num_chunks * (seq_len + 1)].view(num_chunks, seq_len + 1)  # (N, seq_len + 1)

    def __len__(self) -> int:
        return self.chunks.size(0)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        chunk = self.chunks[index]
        return chunk[:-1], chunk[1:]


class RandomTokenDataset(Dataset[tuple[Tensor, Tensor]]):
    """Uniformly random tokens, identical for the same arguments in every process.

    Args:
        num_samples: Number of ``(inputs, targets)`` pairs.
        seq_len: Length of each sequence.
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
        seed: Seed of the ``torch.Generator`` that draws them (the global RNG is not touched).
    """

    def __init__(self, num_samples: int, seq_len: int, *, vocab_size: int = 256, seed: int = 0) -> None:
        for name, value in (("num_samples", num_samples), ("seq_len", seq_len), ("vocab_size", vocab_size)):
            if value <= 0:
                raise ValueError(f"`{name}={value}` must be positive.")
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(vocab_size, (num_samples, seq_len + 1), generator=generator)  # (N, seq_len + 1)

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        sample = self.data[index]
        return sample[:-1], sample[1:]


def _split_sizes(num_chunks: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """Number of chunks for train/val/test; a non-zero fraction always gets at least one chunk."""
    num_val = max(1, round(num_chunks * val_fraction)) if val_fraction > 0 else 0
    num_test = max(1, round(num_chunks * test_fraction)) if test_fraction > 0 else 0
    return num_chunks - num_val - num_test, num_val, num_test


class TextDataModule(LightningDataModule):
    """Byte-level text split into fixed-length chunks, divided into train/val/test sets by a seeded permutation.

    No ``DistributedSampler`` is added here: Lightning inserts one for distributed strategies.

    Args:
        path: A text file, a directory of text files, or ``None`` for the Python standard library's source code.
        seq_len: Tokens per training sequence; must not exceed the model's ``block_size``.
        batch_size: Sequences per batch (per process).
        val_fraction: Fraction of chunks held out for validation.
        test_fraction: Fraction of chunks held out for testing (also used by ``predict``).
        max_bytes: Read at most this many bytes of the corpus; ``None`` reads all of it.
        seed: Seed of the train/val/test split and of the training-set shuffling.
        num_workers: DataLoader worker processes.
        shuffle: Whether to shuffle the training set every epoch.
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        seq_len: int = 64,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_bytes: int | None = 2_000_000,
        seed: int = 0,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        _check_positive(seq_len=seq_len, batch_size=batch_size)
        if not (0.0 <= val_fraction < 1.0 and 0.0 <= test_fraction < 1.0 and val_fraction + test_fraction < 1.0):
            raise ValueError(
                f"`val_fraction={val_fraction}` and `test_fraction={test_fraction}` must be in [0, 1) and sum to "
                "less than 1, so that some data is left for training."
            )
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"`max_bytes={max_bytes}` must be positive, or None to read the whole corpus.")
        if num_workers < 0:
            raise ValueError(f"`num_workers={num_workers}` must be non-negative.")
        self.save_hyperparameters()
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.max_bytes = max_bytes
        self.seed = seed
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.vocab_size = 256
        self._splits: dict[str, Dataset[tuple[Tensor, Tensor]]] | None = None

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load and split the corpus (once; later calls are no-ops). Every process computes the same split."""
        if self._splits is not None:
            return
        dataset = TokenChunkDataset(load_corpus(self.path, self.max_bytes), self.seq_len)
        num_train, num_val, _ = _split_sizes(len(dataset), self.val_fraction, self.test_fraction)
        if num_train < self.batch_size:
            raise ValueError(
                f"The training split has {num_train} sequences, fewer than `batch_size={self.batch_size}`; "
                f"raise `max_bytes={self.max_bytes}` or lower `batch_size` / `seq_len={self.seq_len}`."
            )
        perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.seed))
        # Each split is read in corpus order; only the training loader shuffles.
        bounds = {"train": (0, num_train), "val": (num_train, num_train + num_val), "test": (num_train + num_val, None)}
        self._splits = {
            name: Subset(dataset, perm[start:stop].sort().values.tolist()) for name, (start, stop) in bounds.items()
        }

    def split(self, name: str) -> Dataset[tuple[Tensor, Tensor]]:
        """The ``"train"``, ``"val"`` or ``"test"`` dataset.

        Raises:
            RuntimeError: If called before :meth:`setup`.
        """
        if self._splits is None:
            raise RuntimeError("`TextDataModule.setup()` must run before its datasets or dataloaders are used.")
        return self._splits[name]

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed) if self.shuffle else None
        return self._loader(self.split("train"), shuffle=self.shuffle, drop_last=True, generator=generator)

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(self.split("val"))

    @override
    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(self.split("test"))

    @override
    def predict_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(self.split("test"))

    def _loader(
        self,
        dataset: Dataset[tuple[Tensor, Tensor]],
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


class RandomTokenDataModule(LightningDataModule):
    """Seeded random tokens for tests and benchmarks: the same batches in every process and every run.

    The training set uses ``seed``; validation, test and predict share one set of the same size drawn with
    ``seed + 1``. The training loader drops a last incomplete batch.

    Args:
        num_samples: Sequences in the training set (and in the evaluation set).
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch (per process).
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
        seed: Seed of the data and of the training-set shuffling.
        shuffle: Whether to shuffle the training set every epoch.
    """

    def __init__(
        self,
        num_samples: int = 256,
        *,
        seq_len: int = 64,
        batch_size: int = 8,
        vocab_size: int = 256,
        seed: int = 0,
        shuffle: bool = False,
    ) -> None:
        super().__init__()
        _check_positive(num_samples=num_samples, seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size)
        self.save_hyperparameters()
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.shuffle = shuffle

    def _dataset(self, seed: int) -> RandomTokenDataset:
        return RandomTokenDataset(self.num_samples, self.seq_len, vocab_size=self.vocab_size, seed=seed)

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed) if self.shuffle else None
        return DataLoader(
            self._dataset(self.seed),
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=True,
            generator=generator,
        )

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self._dataset(self.seed + 1), batch_size=self.batch_size)

    @override
    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self.val_dataloader()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"`{name}={value}` must be positive.")
