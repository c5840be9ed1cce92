from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import bert_reduce


def test_import_loads_no_heavy_framework() -> None:
    # Quick import is a property of what gets imported, not a timing: torch, Megatron, NeMo,
    # Lightning and friends must all wait until a public name is first used.
    code = (
        "import sys; import bert_reduce; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'torch', 'megatron', 'lightning', 'nemo', 'torchmetrics', 'hydra'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_needs_torch_alone() -> None:
    # The core extra-free install is torch only: the maths, the report format, the Megatron
    # loss-reduction class and the PyTorch-loop loss must work without Megatron, Lightning,
    # torchmetrics, Hydra or transformers.
    code = (
        "import sys, torch; "
        "from bert_reduce import BERTMLMLossWithReduction, cross_entropy_loss_sum, pack_batch; "
        "import bert_reduce.context_parallel, bert_reduce.reports, bert_reduce.normalization; "
        "import bert_reduce.num_scored; "
        "from bert_reduce import GlobalBatchLoss; "
        "mb = {'labels': torch.tensor([[1, -100]])}; g = GlobalBatchLoss(); g.begin([mb]); "
        "g(torch.zeros(1, 2, 3), mb); assert abs(float(g.end()) - 1.0986122886681098) < 1e-6; "
        "loss = BERTMLMLossWithReduction(); "
        "loss.setup({'labels': torch.tensor([[1, 2]]), "
        "'loss_mask': torch.tensor([[True, False]])}); "
        "_, _, report = loss({'token_logits': torch.zeros(2, 1, 3)}); "
        "assert abs(float(loss.reduce([report])) - float(torch.log(torch.tensor(3.0)))) < 1e-6; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'megatron', 'lightning', 'nemo', 'torchmetrics', 'hydra', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# --- The public names: one per concept, each saying what it takes and returns. -------------


def _singular(word: str) -> str:
    if word.endswith("sses"):  # losses -> loss
        return word[:-2]
    return word if word.endswith("ss") else word.removesuffix("s")  # logits -> logit


def _words(name: str) -> tuple[str, ...]:
    """A name's words, lower case and singular: ``token_losses`` -> ``("token", "loss")``."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", name)
    return tuple(_singular(word.lower()) for word in words)


def _near_twins(names: list[str]) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` where ``b`` is ``a`` but for plurals and trailing words."""
    return [
        (first, second)
        for first in names
        for second in names
        if first != second and _words(second)[: len(_words(first))] == _words(first)
    ]


def test_no_two_top_level_names_differ_only_by_a_plural_or_a_suffix() -> None:
    assert _near_twins(bert_reduce.__all__) == []


def test_naming_rule_catches_near_twins() -> None:
    # The rule above, on the pairs issue 19 found, and on two of today's names.
    before = ["masked_token_loss", "masked_token_losses", "unreduced_token_loss_fn"]
    assert _near_twins([*before, "unreduced_token_loss"]) == [
        ("masked_token_loss", "masked_token_losses"),
        ("masked_token_losses", "masked_token_loss"),
        ("unreduced_token_loss", "unreduced_token_loss_fn"),
    ]
    assert _near_twins(["cross_entropy_loss_sum", "cross_entropy_token_losses"]) == []


def test_each_top_level_function_says_what_it_takes_and_returns() -> None:
    for name in bert_reduce.__all__:
        value = getattr(bert_reduce, name)
        if inspect.isfunction(value):
            first_line = (value.__doc__ or "").strip().splitlines()[0]
            assert " -> " in first_line, f"bert_reduce.{name}: {first_line!r}"


@pytest.mark.parametrize(
    ("module", "old"),
    [
        ("bert_reduce", "masked_cross_entropy"),
        ("bert_reduce.cross_entropy", "select_rows"),
        ("bert_reduce.linear_cross_entropy", "HIDDEN_STATES_KEY"),
        ("bert_reduce.functional", "masked_weighted_sum"),
        ("bert_reduce.metrics", "token_loss_sums"),
    ],
)
def test_no_old_name_resolves(module, old) -> None:
    assert not hasattr(importlib.import_module(module), old)


def test_nemo_and_bionemo_names_need_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from bert_reduce import masked_token_loss, unreduced_token_loss_fn
    assert masked_token_loss is bert_reduce.token_loss_sum
    assert unreduced_token_loss_fn.__module__ == "bert_reduce.cross_entropy"


# --- Layers: core maths -> integrations -> recipe, imports pointing down only. ---------------

PACKAGE = pathlib.Path(bert_reduce.__file__).parent
CORE = {
    # rank: a module imports modules of its own rank or lower, never higher.
    "distributed": 0,
    "forward_output": 0,
    "num_scored": 0,
    "functional": 1,
    "context_parallel": 2,
    "normalization": 2,
    "reports": 2,
    "_vocab_parallel": 2,
    "_fused_head": 2,
    "cross_entropy": 3,
    "linear_cross_entropy": 3,
    "packing": 3,
    "engine": 4,
}
INTEGRATIONS = {
    *("reduction", "torch_loop", "metrics", "hf", "lightning", "megatron", "nemo"),
    *("sampling", "evaluation", "accumulation"),
}
FRAMEWORKS = {
    *("lightning", "nemo", "transformers", "accelerate", "hydra", "omegaconf", "torchmetrics")
}


def _rank(module: str) -> int:
    """``module`` is ``bert_reduce.<part>...``: core by its rank, integrations 10, recipe 20."""
    part = module.split(".")[1]
    if part in CORE:
        return CORE[part]
    if part in INTEGRATIONS:
        return 10
    assert part == "recipe", f"{module} belongs to no layer: add it to CORE or INTEGRATIONS"
    return 20


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at its top or inside functions (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bert_reduce":
                found |= {f"bert_reduce.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return found


def _package_imports() -> dict[str, set[str]]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:  # bert_reduce/__init__.py, the facade, imports everything lazily
            modules[".".join(parts)] = _imports(path)
    return modules


def _upward_and_framework_imports(modules: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in modules.items():
        for name in imported:
            if name.startswith("bert_reduce."):
                if _rank(name) > _rank(module):
                    wrong.append(f"{module} imports {name} from a higher layer")
            elif _rank(module) < 10 and name.split(".")[0] in FRAMEWORKS:
                wrong.append(f"core module {module} imports {name}")
    return wrong


def test_imports_point_down_the_layers_and_the_core_imports_no_framework() -> None:
    modules = _package_imports()
    assert {module.split(".")[1] for module in modules} <= {*CORE, *INTEGRATIONS, "recipe"}
    assert _upward_and_framework_imports(modules) == []


def test_layer_check_catches_an_upward_and_a_framework_import() -> None:
    modules = _package_imports()
    modules["bert_reduce.functional"] = {"bert_reduce.metrics", "lightning.pytorch"}
    assert sorted(_upward_and_framework_imports(modules)) == [
        "bert_reduce.functional imports bert_reduce.metrics from a higher layer",
        "core module bert_reduce.functional imports lightning.pytorch",
    ]
