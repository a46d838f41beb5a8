"""The rule of issue 24: no module of the package assigns to an attribute of an object it does not own (torch,
torch.distributed, Lightning, torchmetrics, the user's module), except the allow-listed sites below, each with its
reason. An AST check, like ``test_layers.py``'s rules; the negative tests show it catches each pattern that existed.

What counts as such a write (the objects' types are unknown to an AST, so the rule reads the forms):

* ``import``: assigning, deleting or ``setattr`` on anything reached from an imported name (``torch.X.y = f``,
  ``dist.all_reduce = f``, ``setattr(schedules, "_batch_p2p", f)``): a process-wide replacement.
* ``setattr``: ``setattr``/``delattr`` with a computed name on anything but ``self`` (``setattr(owner, name, f)``
  replaced torch functions handed in as arguments).
* ``__dict__``: writing through another object's ``__dict__`` or ``vars()`` (an instance attribute that shadows a
  method, a copied plugin state).
* ``private``: assigning another object's ``_private`` field (``metric._update_count = 1``).
* ``foreign parameter``: assigning an attribute of a parameter annotated with a torch, Lightning or torchmetrics
  class (``def f(plugin: Precision): plugin.scaler = s``), tensor fields (``.grad``, ``.data``) aside.
* ``runtime class``: ``type(name, bases, namespace)``, a subclass of someone else's class built at run time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_parallel"
FOREIGN_PACKAGES = ("torch", "lightning", "lightning_utilities", "pytorch_lightning", "torchmetrics")
TENSOR_FIELDS = frozenset({"grad", "data", "requires_grad"})

ALLOWED: dict[tuple[str, str, str], str] = {
    # (file under lightning_parallel/, enclosing function, rule): why
    ("planner/bubble.py", "schedule_order", "runtime class"): "a subclass of one of torch's schedule classes built "
    "only to read its `pipeline_order` on stand-in stages, with its send/recv derivation (quadratic, 15 s at p=32, "
    "m=256) skipped; never run, never put in place of torch's class",
    ("planner/dry_run.py", "answered_locally", "setattr"): "the planner's dry runs play one rank of a fake process "
    "group in their own call: for that call only, the cross-rank answers torch would receive (the real backend's "
    "name: dist.get_backend; in a pipeline all_gather_object, stage metadata, the static/dynamic vote) are computed "
    "locally, fake sends are held like real ones and nn.Module.to leaves fake tensors already in place; every "
    "attribute is put back in `finally`. No training runs meanwhile",
    ("fault_tolerance/replicas.py", "FaultTolerantReplicas._load_state_dict", "private"): "a replica group healed "
    "from a live peer takes its step count: Lightning restores this epoch-loop counter only from its own loop "
    "state_dict (a checkpoint), with no public setter",
    ("strategies/launch.py", "_use_nccl_interface_for_gloo", "import"): "sets GLOO_SOCKET_IFNAME from "
    "NCCL_SOCKET_IFNAME where only NCCL's is set, before the first gloo group: torch reads gloo's interface only from "
    "this variable (its device options are private), and a value the user set is never changed",
    ("accounting.py", "LiveTensorPeak.__enter__", "import"): "wraps torch.UntypedStorage.resize_ for the region: no "
    "dispatcher op or hook reports FSDP2's storage resizes (torch's own MemTracker wraps it too)",
    ("accounting.py", "LiveTensorPeak.__exit__", "import"): "restores torch.UntypedStorage.resize_ (see __enter__)",
    (
        "distributed/pipeline/contract.py",
        "_patched",
        "__dict__",
    ): "the pipeline contract's fallback adapter: the user's "
    "`forward`/`log` answered by the pipeline for one step, when the module does not define `pipeline_inputs`",
    ("distributed/pipeline/contract.py", "replay_logs", "private"): "torchmetrics has no public way to give a Metric "
    "the step value computed on another rank (`_forward_cache`) and mark it as updated (`_update_count`)",
    ("strategies/clipping.py", "_adapted", "__dict__"): "fallback adapter for a user's own precision plugin class, "
    "whose constructor we cannot call: its state copied into the clipping subclass",
    ("strategies/clipping.py", "_adapted", "runtime class"): "the same fallback adapter's subclass (one per class)",
    ("distributed/pipeline/flops.py", "_attributes_restored", "__dict__"): "puts a layer's own attributes back exactly "
    "as they were after a FakeTensor FLOP count (nn.Module.__setattr__ would re-file tensors as buffers)",
    (
        "distributed/zero/stage3_access.py",
        "ShardedModuleAccess.__init__",
        "__dict__",
    ): "our marker on the user's module, so a "
    "later strategy finds and detaches the guard; not via setattr, which would register it as a submodule",
    ("distributed/zero/stage3_access.py", "ShardedModuleAccess.detach", "__dict__"): "removes that marker",
    ("distributed/averaged_copy.py", "hold_copy", "__dict__"): "our marker on the weight-averaging callback's copy "
    "(as in zero3_access)",
    ("distributed/zero/stage3_compat.py", "reshard_after_forward_disabled", "private"): "puts back FSDP2's own "
    "reshard-after-forward setting, which its public setter cannot restore (it cannot express 'auto')",
    ("distributed/zero/stage3_compat.py", "reset_iteration", "private"): "torch 2.11 only (no `reset_iter_state`): "
    "after a failed step, puts FSDP2's units back in their idle state so teardown does not hide the real error; "
    "newer torch calls the public method",
    ("strategies/clipping.py", "with_clipping", "foreign parameter"): "the plugin is one of our clipping classes "
    "(checked with isinstance just above): our own field",
    (
        "strategies/launch.py",
        "configure_launcher",
        "private",
    ): "our strategy's launcher, the field Lightning's Strategy "
    "reads (Lightning's own strategies set it in `_configure_launcher`, which calls this)",
    ("distributed/pipeline/reassemble.py", "_retie", "setattr"): "model surgery on this rank's copy of the layers: one "
    "nn.Parameter for every user of a tied weight, through nn.Module's attribute protocol (as torch pipelining does)",
    ("distributed/pipeline/reassemble.py", "_assign", "setattr"): "model surgery: a received parameter "
    "or buffer put in its place in this rank's layer",
    ("distributed/pipeline/side_effects.py", "_restore_buffers", "setattr"): "puts a buffer's saved value back after "
    "torch's shape inference ran the stage (nn.Module's protocol keeps it a buffer)",
    (
        "distributed/pipeline/model_plan.py",
        "run_around_blocks",
        "setattr",
    ): "while recording a Hugging Face model's block "
    "inputs once at set-up, its embeddings are skipped (nn.Identity) when the caller passes embeddings; restored after",
}


@dataclass(frozen=True)
class Write:
    path: str
    function: str
    rule: str
    line: int
    text: str


def _root(node: ast.AST) -> ast.AST:
    """The name an attribute chain starts from (``layer`` of ``layer.get_submodule(p).x``, ``obj`` of
    ``cast(T, obj).x``); a plain call's result (``f().x``) is its own root."""
    while True:
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cast":
            node = node.args[1]
        else:
            return node


def _is_self(node: ast.AST) -> bool:
    """Whether the object written to is ``self`` (``self.x = v``, ``setattr(self, n, v)``, ``self.__dict__[k] = v``):
    its own state. ``self.module.forward = f`` writes to another object, the one ``self`` holds."""
    if isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            node = node.value
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.imported: set[str] = set()
        self.foreign_classes: set[str] = set()
        self.writes: list[Write] = []
        self._scope: list[str] = []
        self._foreign_params: list[set[str]] = [set()]

    # ------------------------------------------------------------------ bindings
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imported.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        foreign = (node.module or "").split(".")[0] in FOREIGN_PACKAGES and node.level == 0
        for alias in node.names:
            name = alias.asname or alias.name
            self.imported.add(name)
            if foreign:
                self.foreign_classes.add(name)

    def _annotation_is_foreign(self, annotation: ast.AST | None) -> bool:
        if annotation is None:
            return False
        for node in ast.walk(annotation):
            if (
                isinstance(node, ast.Name)
                and node.id in self.foreign_classes
                and node.id not in ("Tensor", "Parameter")
            ):
                return True
            if isinstance(node, ast.Attribute) and isinstance(_root(node), ast.Name):
                root = _root(node)
                assert isinstance(root, ast.Name)
                if root.id in ("torch", "nn", "pl", "lightning", "torchmetrics") and node.attr not in (
                    "Tensor",
                    "Parameter",
                ):
                    return True
            if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
                return self._annotation_is_foreign(ast.parse(node.value, mode="eval").body)
        return False

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        foreign = {a.arg for a in arguments if self._annotation_is_foreign(a.annotation)}
        self._scope.append(node.name)
        self._foreign_params.append(foreign)
        self.generic_visit(node)
        self._foreign_params.pop()
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    # ------------------------------------------------------------------ writes
    def _flag(self, rule: str, node: ast.AST) -> None:
        function = ".".join(self._scope[-2:]) if len(self._scope) > 1 and self._scope[-2][:1].isupper() else ""
        function = function or (self._scope[-1] if self._scope else "<module>")
        text = ast.get_source_segment(self.source, node) or ""
        self.writes.append(Write(self.path, function, rule, getattr(node, "lineno", 0), text.splitlines()[0]))

    def _check_target(self, target: ast.AST, statement: ast.AST) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._check_target(element, statement)
            return
        if not isinstance(target, ast.Attribute | ast.Subscript):
            return
        root = _root(target)
        if isinstance(root, ast.Name) and root.id in self.imported:
            self._flag("import", statement)
        elif _writes_through_dict(target) and not _is_self(target):
            self._flag("__dict__", statement)
        elif isinstance(target, ast.Attribute) and not _is_self(target):
            if target.attr.startswith("_") and not target.attr.startswith("__"):
                self._flag("private", statement)
            elif (
                isinstance(target.value, ast.Name)
                and target.value.id in self._foreign_params[-1]
                and target.attr not in TENSOR_FIELDS
            ):
                self._flag("foreign parameter", statement)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check_target(target, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._check_target(target, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            obj = node.args[0]
            root = _root(obj)
            name_is_literal = len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
            if isinstance(root, ast.Name) and root.id in self.imported:
                self._flag("import", node)
            elif not name_is_literal and not _owned(obj):
                self._flag("setattr", node)
            elif name_is_literal and not _owned(obj):
                attribute = ast.Attribute(value=obj, attr=str(node.args[1].value), ctx=ast.Store())  # type: ignore[attr-defined]
                self._check_target(attribute, node)
        elif isinstance(func, ast.Name) and func.id == "type" and len(node.args) == 3:
            self._flag("runtime class", node)
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in ("update", "setdefault", "pop", "clear", "__setitem__")
            and _is_dict_access(func.value)
            and not _is_self(func)
        ):
            self._flag("__dict__", node)
        self.generic_visit(node)


def _owned(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_dict_access(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"


def _writes_through_dict(target: ast.AST) -> bool:
    return isinstance(target, ast.Subscript) and _is_dict_access(target.value)


def foreign_writes(source: str, path: str = "<string>") -> list[Write]:
    """Every write of ``source`` the rule forbids (before the allow-list)."""
    checker = _Checker(path, source)
    tree = ast.parse(source)
    for node in ast.walk(tree):  # imports anywhere in the module bind names first
        if isinstance(node, ast.Import | ast.ImportFrom):
            checker.visit(node)
    checker.visit(tree)
    return checker.writes


def test_no_module_writes_to_objects_it_does_not_own() -> None:
    found: list[Write] = []
    for file in sorted(PACKAGE_DIR.rglob("*.py")):
        path = file.relative_to(PACKAGE_DIR).as_posix()
        found += foreign_writes(file.read_text(), path)
    unexplained = [w for w in found if (w.path, w.function, w.rule) not in ALLOWED]
    assert unexplained == [], "\n".join(f"{w.path}:{w.line} [{w.rule}] in {w.function}: {w.text}" for w in unexplained)
    stale = set(ALLOWED) - {(w.path, w.function, w.rule) for w in found}
    assert stale == set(), f"allow-list entries that no longer match a write (remove them): {sorted(stale)}"


@pytest.mark.parametrize(
    ("source", "rule"),
    [
        # The patterns that existed (issue 24), each in a small synthetic module.
        ("import torch\ndef enter(f):\n    torch.UntypedStorage.resize_ = f\n", "import"),
        ("import torch.distributed as dist\ndist.all_reduce = None\n", "import"),
        ("from torch.distributed.pipelining import schedules\nsetattr(schedules, '_batch_p2p', None)\n", "import"),
        ("def wrap(owner, name, f):\n    setattr(owner, name, f)\n", "setattr"),
        (
            "def adapt(plugin, cls):\n    wrapped = cls.__new__(cls)\n    wrapped.__dict__.update(plugin.__dict__)\n",
            "__dict__",
        ),
        ("def patch(target, forward):\n    target.__dict__['forward'] = forward\n", "__dict__"),
        ("def replay(metric):\n    metric._update_count = 1\n", "private"),
        (
            "from lightning.pytorch.plugins import Precision\n"
            "def scaled(plugin: Precision, s):\n    plugin.scaler = s\n",
            "foreign parameter",
        ),
        ("def stage_class(base):\n    return type('Stage', (base,), {})\n", "runtime class"),
    ],
)
def test_the_rule_catches_each_pattern(source: str, rule: str) -> None:
    assert [w.rule for w in foreign_writes(source)] == [rule]


def test_the_rule_leaves_own_state_alone() -> None:
    source = (
        "import torch\n"
        "class Stage:\n"
        "    def __init__(self, t: torch.Tensor):\n"
        "        self.on_chunk = None\n"
        "        setattr(self, 'x', 1)\n"
        "        self._cache = {}\n"
        "        t.grad = None\n"
        "def drop(p: torch.nn.Parameter, stage):\n"
        "    p.grad = None\n"
        "    stage.on_chunk = print\n"
    )
    assert foreign_writes(source) == []
