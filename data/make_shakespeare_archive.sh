#!/usr/bin/env bash
# Rebuilds data/shakespeare.tar.gz reproducibly (sorted names, fixed mtime,
# owner and modes, no gzip timestamp) from a directory of the public-domain
# Shakespeare texts. Usage: data/make_shakespeare_archive.sh [SRC_PARENT]
# where SRC_PARENT contains the folder `shakespeare/`.
set -euo pipefail
src="${1:-/work/shared/data}"
here="$(cd "$(dirname "$0")" && pwd)"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
    --mode='u=rwX,go=rX' --format=ustar -cf - -C "$src" shakespeare \
  | gzip -9 -n > "$here/shakespeare.tar.gz"
sha256sum "$here/shakespeare.tar.gz"
