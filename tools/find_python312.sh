#!/usr/bin/env bash
# Print the path of a working Python 3.12 interpreter: PATH first, then pyenv, then pyenv's folders.
ok() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }
for c in python3.12 python3 python; do
  p=$(command -v "$c" 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -rV); do
    p=$(PYENV_VERSION=$v pyenv which python3.12 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
  done
fi
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  ok "$p" && { echo "$p"; exit 0; }
done
exit 1
