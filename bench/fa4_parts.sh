#!/usr/bin/env bash
# The device side of bench/prepare_fa4.sh: `keep` copies this call's carried part of the
# flash-attn 4 wheels into /tmp/fa4 (kept by a warm machine for a call within 30 s); `install`
# adds the last one, checks the whole tar against its sha256 and installs the wheels into
# /tmp/site (no index, no dependencies: every one is in the tar).
set -euo pipefail
mkdir -p /tmp/fa4
for part in .fa4-1 .fa4-2 .fa4-3; do
  [ -d "$part" ] && cp "$part"/* /tmp/fa4/
done
case "${1:-}" in
  keep) ls -la /tmp/fa4 ;;
  install)
    missing=$(for k in 0 1 2; do [ -f "/tmp/fa4/part-$k" ] || echo "part-$k"; done)
    if [ -n "$missing" ]; then
      echo "missing $missing: a fresh machine (the earlier calls' /tmp went with the old one);" \
        "start over with call 1" >&2
      exit 4
    fi
    cat /tmp/fa4/part-0 /tmp/fa4/part-1 /tmp/fa4/part-2 > /tmp/fa4/fa4.tar
    [ "$(sha256sum /tmp/fa4/fa4.tar | cut -d' ' -f1)" = "$(cat /tmp/fa4/fa4.tar.sha256)" ] \
      || { echo "the reassembled tar does not match its sha256" >&2; exit 1; }
    mkdir -p /tmp/fa4/wheels
    tar xf /tmp/fa4/fa4.tar -C /tmp/fa4/wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
      /tmp/fa4/wheels/*.whl
    # nvidia-cutlass-dsl puts its `cutlass` package on sys.path from a .pth file, and Python
    # reads .pth files only in site directories, not in PYTHONPATH's: resolve them here into
    # the PYTHONPATH the benchmark exports (`export PYTHONPATH=$(cat /tmp/fa4/pythonpath)`)
    python3 -c "import site, sys; before = list(sys.path); site.addsitedir('/tmp/site'); \
print(':'.join([p for p in sys.path if p not in before] + ['/tmp/site']))" > /tmp/fa4/pythonpath
    PYTHONPATH=$(cat /tmp/fa4/pythonpath) python3 -c \
      "import cutlass, flash_attn.cute; print('flash_attn.cute', flash_attn.cute.__file__)"
    ;;
  *) echo "usage: bash bench/fa4_parts.sh keep|install" >&2; exit 2 ;;
esac
