"""What replica groups compare when they meet, before their first cross-group collective of parameters or gradients.

Groups configured differently (another model width, ``shard_size``, precision, process count) would otherwise send
buffers of different sizes to one all-reduce: gloo aborts the process (``EnforceNotMet``), a rank with no peer times
out with a nameless ``TimeoutError``, and the other group trains on alone. Instead each group describes itself as
a few named fields (:class:`GroupDescription`), and the groups of a new quorum compare them in two fixed-size
collectives (:func:`compare_descriptions`):

1. one ``MAX`` all-reduce of ``4 * F + 1`` int64 (``F = len(FIELDS)``): every field hashed separately (62 bits),
   once counting only the groups that hold the run's state (participating) and once every group, each also as
   ``M - hash`` so that the maximum of both gives the minimum as well (a group that does not count sends zeros,
   neutral for ``MAX``), and the longest description's length;
2. only when some field differs: a ``SUM`` all-reduce of one row of bytes per group (its readable description, at
   its rank in the quorum), so every group can name the difference.

Torch-only (no torchft): ``all_reduce`` is any collective over the groups.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ReduceOp

__all__ = ["FIELDS", "GroupDescription", "ReplicaGroupMismatchError", "compare_descriptions", "describe_mismatch"]

FIELDS = (
    "strategy",
    "processes_per_group",
    "shard_size",
    "bucket_shards",
    "precision",
    "gradient_clipping",
    "num_replica_groups",
    "min_replica_groups",
    "start_together",
    "parameters",
)
"""The compared fields, in their order in the exchanged tensor (the same on every group running this code)."""

_MODULUS = 2**62
"""Hashes lie in ``[1, _MODULUS)``; ``_MODULUS - hash`` too, so a zero (a group not counted) never wins a ``MAX``."""

AllReduce = Callable[[Tensor, ReduceOp.RedOpType], None]
"""In place, across the groups of the quorum, waited for."""


class ReplicaGroupMismatchError(RuntimeError):
    """Replica groups of one fault-tolerant run are configured differently (the message names every difference)."""


@dataclass(frozen=True)
class GroupDescription:
    """One replica group's description: ``replica_group`` and a value per name of :data:`FIELDS` (JSON-able)."""

    replica_group: int
    fields: dict[str, Any]

    @classmethod
    def of(
        cls,
        module: nn.Module,
        *,
        replica_group: int,
        strategy: str,
        processes_per_group: int,
        precision: str,
        num_replica_groups: int,
        min_replica_groups: int = 1,
        start_together: bool = True,
        gradient_clipping: str | None = None,
        shard_size: int | None = None,
        bucket_shards: Sequence[int] = (),
    ) -> GroupDescription:
        """Local. The description of ``module``'s trainable parameters (name, shape, dtype) and of the settings given
        (each group's commit decision depends on ``min_replica_groups``; a group with ``start_together`` exchanges
        parameters while one without it sends gradients; clipping the same average differently splits the weights)."""
        parameters = [
            [name, list(parameter.shape), str(parameter.dtype).removeprefix("torch.")]
            for name, parameter in module.named_parameters()
            if parameter.requires_grad
        ]
        fields = {
            "strategy": strategy,
            "processes_per_group": processes_per_group,
            "shard_size": shard_size,
            "bucket_shards": list(bucket_shards),
            "precision": precision,
            "gradient_clipping": gradient_clipping,
            "num_replica_groups": num_replica_groups,
            "min_replica_groups": min_replica_groups,
            "start_together": start_together,
            "parameters": parameters,
        }
        return cls(replica_group, fields)

    def hashes(self) -> list[int]:
        """One hash per field of :data:`FIELDS`, in ``[1, 2**62)``."""
        return [_hash(self.fields.get(name)) for name in FIELDS]

    def encoded(self) -> bytes:
        return json.dumps({"replica_group": self.replica_group, "fields": self.fields}).encode()


def _hash(value: Any) -> int:
    digest = hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (_MODULUS - 1) + 1


def compare_descriptions(
    description: GroupDescription,
    *,
    counts: bool,
    rank: int,
    size: int,
    all_reduce: AllReduce,
    device: torch.device | None = None,
) -> tuple[str | None, bool]:
    """Collective across the ``size`` groups of a quorum (this one at ``rank``): compare every group's ``description``.

    ``counts``: this group holds the run's state (it is not healing); the groups that count are the reference a
    healing group is compared with. Returns ``(message, refused)``: ``message`` names every difference (``None`` when
    all agree); ``refused`` says whether this group must stop: always when the groups that count disagree among
    themselves (e.g. all groups starting together), else only a group whose description differs from theirs (a healing
    group; the others go on without it)."""
    fields = len(FIELDS)
    hashes = torch.tensor(description.hashes(), dtype=torch.int64)
    encoded = description.encoded()
    summary = torch.zeros(4 * fields + 1, dtype=torch.int64)
    if counts:
        summary[:fields] = hashes
        summary[fields : 2 * fields] = _MODULUS - hashes
    summary[2 * fields : 3 * fields] = hashes
    summary[3 * fields : 4 * fields] = _MODULUS - hashes
    summary[-1] = len(encoded)
    summary = summary.to(device) if device is not None else summary
    all_reduce(summary, ReduceOp.MAX)
    summary = summary.cpu()
    counted_max, counted_min = summary[:fields], _MODULUS - summary[fields : 2 * fields]
    every_max, every_min = summary[2 * fields : 3 * fields], _MODULUS - summary[3 * fields : 4 * fields]
    if torch.equal(every_max, every_min):
        return None, False
    # Someone differs, seen alike by every group: exchange the readable descriptions, one row of bytes per group.
    rows = torch.zeros(size, int(summary[-1]), dtype=torch.uint8)
    rows[rank, : len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    rows = rows.to(device) if device is not None else rows
    all_reduce(rows, ReduceOp.SUM)
    descriptions = [_decode(row) for row in rows.cpu()]
    counted_agree = torch.equal(counted_max, counted_min)
    mine_agrees = all(
        int(counted_max[i]) in (0, value) and int(counted_min[i]) in (_MODULUS, value)
        for i, value in enumerate(hashes.tolist())
    )
    refused = not counted_agree or not (counts or mine_agrees)
    return describe_mismatch(descriptions), refused


def _decode(row: Tensor) -> GroupDescription:
    text = bytes(row.tolist()).rstrip(b"\0").decode()
    data = json.loads(text)
    return GroupDescription(int(data["replica_group"]), data["fields"])


def describe_mismatch(descriptions: Sequence[GroupDescription]) -> str:
    """The differences between the ``descriptions`` of the groups of a quorum, each named with every group's value."""
    descriptions = sorted(descriptions, key=lambda description: description.replica_group)
    parts = []
    for name in FIELDS:
        values = [description.fields.get(name) for description in descriptions]
        if all(value == values[0] for value in values):
            continue
        if name == "parameters":
            parts.append(_parameter_difference(descriptions))
        else:
            parts.append(
                f"`{name}` is "
                + ", ".join(
                    f"{_show(description.fields.get(name))} in replica group {description.replica_group}"
                    for description in descriptions
                )
            )
    return (
        "FaultTolerance: the replica groups that met are configured differently, so they cannot average their"
        f" gradients: {'; '.join(parts)}. Start every replica group with the same model, strategy (stage,"
        " `shard_size`, `bucket_cap_mb`), precision, number of processes (devices x nodes) and"
        " `num_replica_groups`."
    )


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


def _parameter_difference(descriptions: Sequence[GroupDescription]) -> str:
    """The first trainable parameter whose name, shape or dtype differs between two groups, or the counts."""
    first = descriptions[0]
    mine = first.fields["parameters"]
    for other in descriptions[1:]:
        theirs = other.fields["parameters"]
        for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a[0] != b[0]:
                return (
                    f"trainable parameter #{index} is `{a[0]}` in replica group {first.replica_group} and `{b[0]}` in"
                    f" replica group {other.replica_group}"
                )
            for what, x, y in (("shape", tuple(a[1]), tuple(b[1])), ("dtype", a[2], b[2])):
                if x != y:
                    return (
                        f"parameter `{a[0]}` has {what} {x} in replica group {first.replica_group} and {y} in replica"
                        f" group {other.replica_group}"
                    )
        if len(mine) != len(theirs):
            return (
                f"replica group {first.replica_group} has {len(mine)} trainable parameters and replica group"
                f" {other.replica_group} has {len(theirs)}"
            )
    return "the trainable parameters differ"
