"""Which Triton tiles inductor gave the flex_attention kernels it compiled: read from the
generated kernel sources in an inductor cache folder.

The twenty-first session timed the same compiled region (same seed, same machine, torch 2.11)
at 0.60 to 0.99 ms fwd+bwd in five processes, cold and warm caches alike. Whether two processes
got different kernel configurations (tiles, stages, warps) or the same kernels ran at different
speeds is what this tells: `bench/bench_attention.py --sweep --fresh-cache` compiles into an
empty cache folder and reports what it finds there beside the times.

Generated template kernels carry their configuration as constexpr lines
(``BLOCK_M1 : tl.constexpr = 32``) and the launch settings in the decorator
(``num_stages=3, num_warps=4``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_KERNEL = re.compile(r"^def (triton_\w*flex_attention\w*)\(", re.M)
# where a kernel's body ends: the next top-level def or decorator, or the end of the string
# that holds it inside inductor's output code (async_compile.triton('...', '''...'''))
_BODY_END = re.compile(r"^(?:def |@|\S*''')", re.M)
# the tiles and block sizes; other constexprs (scales, flags, head dims) are the problem's
_CONSTANT = re.compile(r"^\s+((?:BLOCK|SPARSE)_\w+)\s*:\s*tl\.constexpr\s*=\s*(\d+)\s*$", re.M)
_LAUNCH = re.compile(r"\b(num_stages|num_warps)=(\d+)")


def kernel_tiles(source: str) -> list[dict[str, Any]]:
    """Each flex kernel defined in one generated source file: its name, whether the graph runs
    it ("chosen") or inductor only considered it ("candidate"), its tile constants and launch
    settings (from the decorator just above its def)."""
    found = []
    matches = list(_KERNEL.finditer(source))
    for i, match in enumerate(matches):
        end = _BODY_END.search(source, match.end())
        body = source[match.end() : end.start() if end else len(source)]
        # the decorator sits between the previous kernel (or the file's start) and this def
        start = matches[i - 1].end() if i else 0
        decorator = source[start : match.start()].rsplit("@triton_heuristics", 1)[-1]
        # inductor writes a file for each candidate it considers (triton_flex_attention...);
        # the kernels the compiled graph runs are the fused templates (triton_tem_...)
        role = "chosen" if match[1].startswith("triton_tem_") else "candidate"
        record: dict[str, Any] = {"kernel": match[1], "role": role}
        record.update({name: int(value) for name, value in _LAUNCH.findall(decorator)})
        record.update({name: int(value) for name, value in _CONSTANT.findall(body)})
        found.append(record)
    return found


def cached_flex_kernels(cache_dir: str | Path) -> list[dict[str, Any]]:
    """Every distinct flex kernel configuration among the generated sources under `cache_dir`
    (an inductor cache folder), sorted by kernel name."""
    seen: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(cache_dir).rglob("*.py")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if "flex_attention" not in text:
            continue
        for record in kernel_tiles(text):
            seen.setdefault(repr(sorted(record.items())), record)
    return sorted(seen.values(), key=lambda r: (r["kernel"], repr(sorted(r.items()))))
