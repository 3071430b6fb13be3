"""Exact comparisons in the tests hold on any CPU (issue 46).

Exact bits are promised product against product: shard counts, batches, resume, executors, the same call twice.
Against an independent computation (numpy, scipy, a test's own arithmetic) they are not: OpenBLAS and ATen pick
their kernels by CPU (OpenBLAS's SkylakeX kernel adds a dot product's terms in another order than its Haswell
one), and numpy's and torch's exp, log and the like are vectorized differently on different CPUs. Such a
comparison is made within a bound derived from the computation (tests/closeness.py: sum_rounding), written next
to it; or, where the result is exact by construction, the comparison says why in a comment `# exact: <why>`.

The check reads tests/*.py with `ast` and imports nothing. In every function it flags an exact comparison with an
independent operand, unless a line of the comparison, or the line above it, carries `# exact:`.

* Exact comparisons: calls of `torch.equal`, `np.array_equal`, `np.array_equiv`, `np.testing.assert_array_equal`,
  `np.testing.assert_equal`; `torch.testing.assert_close` with rtol=0 and atol=0; and `==`, `!=`.
* An operand is independent when its expression contains floating-point work whose bits depend on the kernel:
  the matrix product `@`; a call of a numpy, scipy, torch or math function, or a method, named in FLOATING
  (sums, means, products, norms, linear algebra, transcendental functions; any function of scipy); or a call of
  a function that the same file defines whose body contains such work (followed through the file's functions).
  Names are followed back through what the enclosing function assigned to them (`=`, `+=`, `for`, `with`): as
  far back as assignments go for the calls, one assignment back for `==` and `!=` (which also compare counts,
  names and shapes everywhere: one operand that cannot hold a float, len(...), a string, a shape, a literal, is
  left out, and so are comparisons outside an assert's test, inside a subscript (a filter) or with pytest.approx).
* Not flagged: elementwise +, -, *, /, sqrt (correctly rounded: the same bits everywhere), selections, copies,
  casts, and integer work under names outside FLOATING. For that reason the method x.sum() (of counts as often
  as not) is left out; `np.sum`, `torch.sum` and `.mean()` are in.

Run `python tests/test_exact_comparisons.py` for every exact comparison with an independent operand, marked or not.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARK = "# exact:"

# numpy, scipy, torch and math functions and methods whose floating-point result depends on the order of
# additions or on how a transcendental function is vectorized
FLOATING = frozenset({
    "sum", "nansum", "mean", "nanmean", "average", "prod", "cumsum", "cumprod", "dot", "vdot", "inner", "outer",
    "matmul", "mm", "bmm", "mv", "einsum", "tensordot", "addmm", "baddbmm", "linear", "conv1d", "conv2d", "norm",
    "vector_norm", "std", "var", "median", "quantile", "percentile", "trapz", "trapezoid", "logsumexp", "softmax",
    "log_softmax", "cross_entropy", "exp", "expm1", "exp2", "log", "log1p", "log2", "log10", "power", "pow",
    "float_power", "sin", "cos", "tan", "tanh", "sinh", "cosh", "arctan", "arctan2", "atan2", "arcsin", "arccos",
    "sigmoid", "erf", "erfc", "lgamma", "fsum", "hypot", "solve", "lstsq", "inv", "pinv", "eig", "eigh",
    "eigvalsh", "svd", "cholesky", "det", "slogdet", "fft", "ifft", "rfft", "irfft", "convolve",
})
ARITHMETIC_MODULES = frozenset({"np", "numpy", "torch", "math", "F", "scipy", "linalg", "special"})
EXACT_CALLS = frozenset({"equal", "array_equal", "array_equiv", "assert_array_equal", "assert_equal"})
METHOD_EXCEPTIONS = frozenset({"sum"})  # x.sum(): counts as often as not; np.sum / torch.sum are flagged


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    text: str
    marked: bool

    def __str__(self) -> str:
        return f"{self.path.relative_to(TESTS.parent)}:{self.line}: {self.text}" + (" [# exact:]" if self.marked else "")


def _dotted(node: ast.AST) -> list[str]:
    """`np.linalg.norm` -> ["np", "linalg", "norm"]; [] for what is no chain of attributes from a name."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    return [node.id, *out[::-1]] if isinstance(node, ast.Name) else []


def _floating_call(call: ast.Call, helpers: set[str]) -> bool:
    """A call of a function of the file that does floating work (`helpers`), of scipy, or of a function or method
    named in FLOATING (x.sum() aside: see the module's docstring)."""
    if isinstance(call.func, ast.Name):
        return call.func.id in helpers
    if not isinstance(call.func, ast.Attribute):
        return False
    name, owner = call.func.attr, _dotted(call.func.value)  # owner [] when a value that is no name: f(x).mean()
    if "scipy" in owner:
        return True
    if owner and owner[0] in ARITHMETIC_MODULES:  # np.sum, np.linalg.norm, torch.exp, math.fsum
        return name in FLOATING
    return name in FLOATING and name not in METHOD_EXCEPTIONS


def _direct_work(node: ast.AST, helpers: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.MatMult):
            return True
        if isinstance(sub, ast.AugAssign) and isinstance(sub.op, ast.MatMult):
            return True
        if isinstance(sub, ast.Call) and _floating_call(sub, helpers):
            return True
    return False


def floating_helpers(tree: ast.Module) -> set[str]:
    """The names of the file's functions (at any depth) whose bodies do floating work, directly or by calling
    another such function of the file."""
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: set[str] = set()
    while True:
        more = {name for name, f in functions.items() if name not in found and _direct_work(f, found)}
        if not more:
            return found
        found |= more


def _assignments(function: ast.AST) -> dict[str, list[ast.AST]]:
    """name -> the expressions the function assigns to it (unpacking assigns the whole value to each name)."""
    out: dict[str, list[ast.AST]] = {}

    def bind(target: ast.AST, value: ast.AST) -> None:
        for name in ast.walk(target):
            if isinstance(name, ast.Name):
                out.setdefault(name.id, []).append(value)

    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            bind(node.target, node.value if isinstance(node, ast.AnnAssign) else node)
        elif isinstance(node, (ast.For, ast.comprehension)):
            bind(node.target, node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bind(node.optional_vars, node.context_expr)
        elif isinstance(node, ast.NamedExpr):
            bind(node.target, node.value)
    return out


def independent(expr: ast.AST, assigned: dict[str, list[ast.AST]], helpers: set[str], hops: int) -> bool:
    """Whether `expr`, or what its names were assigned (followed back `hops` assignments deep), does floating
    work."""
    seen: set[str] = set()
    work = [(expr, 0)]
    while work:
        node, depth = work.pop()
        if _direct_work(node, helpers):
            return True
        if depth == hops:
            continue
        for name in ast.walk(node):
            if isinstance(name, ast.Name) and name.id in assigned and name.id not in seen:
                seen.add(name.id)
                work += [(value, depth + 1) for value in assigned[name.id]]
    return False


NOT_FLOAT = frozenset({"len", "int", "bool", "str", "repr", "type", "sorted", "set", "list", "tuple", "dict", "round"})
NOT_FLOAT_ATTRS = frozenset({"shape", "dtype", "ndim", "size", "keys", "names", "columns", "index", "status", "key"})


def _maybe_float(operand: ast.AST) -> bool:
    """False for an operand that cannot hold a float: len(...), int(...), a string, a shape, a dtype, a literal."""
    if isinstance(operand, (ast.JoinedStr, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Compare)):
        return False
    if isinstance(operand, ast.Call) and isinstance(operand.func, ast.Name) and operand.func.id in NOT_FLOAT:
        return False
    if isinstance(operand, ast.Call) and isinstance(operand.func, ast.Attribute) and \
            operand.func.attr in NOT_FLOAT_ATTRS:
        return False
    return not (isinstance(operand, ast.Attribute) and operand.attr in NOT_FLOAT_ATTRS)


def _approx(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func)[-1:] == ["approx"]


def _exact_operands(node: ast.AST, asserted: set[int]) -> list[ast.AST] | None:
    """The operands that may hold floats of an exact comparison, None if `node` is none. `==` and `!=` count in
    an assert's test (not inside a subscript: a filter) and not against pytest.approx."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        if id(node) not in asserted or not any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) or \
                any(_approx(o) for o in operands):
            return None
        return [o for o in operands if _maybe_float(o)]
    if not isinstance(node, ast.Call):
        return None
    parts = _dotted(node.func)
    if parts and parts[-1] in EXACT_CALLS and len(parts) > 1 and parts[0] in ("np", "numpy", "torch"):
        return list(node.args)
    if parts and parts[-1] == "assert_close":
        kw = {k.arg: k.value for k in node.keywords}
        zero = [isinstance(kw.get(k), ast.Constant) and kw[k].value == 0 for k in ("rtol", "atol")]
        return list(node.args) if all(zero) else None
    return None


def _asserted(function: ast.AST) -> set[int]:
    """ids of the comparisons an assert statement tests, outside subscripts (a filter such as t[t.x == 1])."""
    out: set[int] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Subscript):
            return
        if isinstance(node, ast.Compare):
            out.add(id(node))
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            visit(node.test)
    return out


def findings(source: str, path: Path) -> list[Finding]:
    """Every exact comparison in `source` with an independent operand, marked `# exact:` or not."""
    tree = ast.parse(source)
    lines = source.splitlines()
    helpers = floating_helpers(tree)
    out, seen = [], set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned, asserted = _assignments(function), _asserted(function)
        for node in ast.walk(function):
            operands = _exact_operands(node, asserted)
            hops = 1 if isinstance(node, ast.Compare) else len(assigned)  # `==`: what a name was assigned directly
            if not operands or not any(independent(o, assigned, helpers, hops) for o in operands):
                continue
            if node.lineno in seen:  # one finding a line; a nested function is walked from its parent too
                continue
            seen.add(node.lineno)
            span = lines[max(0, node.lineno - 2):node.end_lineno]
            out.append(Finding(path, node.lineno, lines[node.lineno - 1].strip(), any(MARK in s for s in span)))
    return out


def all_findings() -> list[Finding]:
    return [f for path in sorted(TESTS.glob("*.py")) for f in findings(path.read_text(), path)]


def test_no_unmarked_exact_comparison_against_an_independent_computation():
    bad = [f for f in all_findings() if not f.marked]
    assert not bad, (f"{len(bad)} exact comparison(s) against an independent computation: compare within a bound "
                     "derived from the computation (tests/closeness.py), or say why the bits are exact in a comment "
                     "`# exact: <why>`:\n" + "\n".join(f"  {f}" for f in bad))


def test_the_check_sees_the_krum_comparison_of_issue_46():
    """tests/test_rfa_cclip.py before issue 46: Krum on the product's bucket means against Krum on numpy's, whose
    w[g] @ u[g] went to OpenBLAS's SkylakeX kernel on an AVX-512 machine and differed in the last bit."""
    source = '''
def np_buckets(u, w, size, key):
    groups = [order[i:i + size] for i in range(0, len(u), size)]
    return np.stack([w[g] @ u[g] / w[g].sum() for g in groups]), np.array([w[g].sum() for g in groups])


def test_bucketing_serves_krum(n):
    u, w = updates(n=n)
    bu, bw = np_buckets(u, w, 2, key)
    got = Krum(byzantine=1, bucket_size=2).aggregate_keyed(torch.tensor(u), torch.tensor(w), key)
    assert torch.equal(got, Krum(byzantine=1).aggregate(torch.tensor(bu), torch.tensor(bw)))
    assert len(bu) == -(-n // 2)
    assert torch.equal(got, again)  # the same call twice: not independent
    assert np.array_equal(np.exp(u), want)  # exact: a marked one
'''
    found = findings(source, TESTS / "example.py")
    assert [(f.line, f.marked) for f in found] == [(11, False), (14, True)]


def test_the_check_leaves_counts_selections_and_elementwise_work_alone():
    source = '''
def test_counts(x, share):
    assert (x == 3).sum() == share and len(x) == 4
    assert np.array_equal(np.sort(x), np.arange(4))
    assert torch.equal(x * 0.5, y[idx])
    assert torch.testing.assert_close(a, b, rtol=0, atol=0) is None
    assert torch.testing.assert_close(a, np.exp(b), rtol=1e-12, atol=0) is None
'''
    assert findings(source, TESTS / "example.py") == []


if __name__ == "__main__":
    for finding in all_findings():
        print(finding)
    sys.exit(0)
