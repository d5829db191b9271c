# Shared by the project's scripts: `. scripts/lib.sh` (from the repository root).

# Installs the Debian packages among "$@" that are not installed yet (root needed only then).
ensure_debs() {
  local missing=() p
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing ${missing[*]}" >&2
  [ "$(id -u)" = 0 ] || { echo "need root to apt-get install ${missing[*]}" >&2; exit 2; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# What building mralloc needs (rdma-sys: pkg-config + bindgen over libibverbs/librdmacm).
BUILD_DEBS=(pkgconf libibverbs-dev librdmacm-dev libclang-dev)

# Median time in ns of criterion benchmark group/function/param from the last run; fails (prints
# nothing) when that benchmark has no estimate. Callers clear target/criterion before the run, so
# a number is never an older run's.
criterion_median() {
  local f="target/criterion/$1/new/estimates.json"
  [ -f "$f" ] || { echo "criterion: missing $f" >&2; return 1; }
  grep -o '"median":{[^}]*}[^}]*}' "$f" | grep -o '"point_estimate":[0-9.e+-]*' | head -1 | cut -d: -f2
}

# Reads numbers (one per line) on stdin; prints "median min max" (median of an even count: the
# mean of the two middle values). Fails when there is no number.
spread() {
  sort -g | awk '{ r[++m] = $1 } END {
    if (m == 0) exit 1
    med = (m % 2) ? r[(m + 1) / 2] : (r[m / 2] + r[m / 2 + 1]) / 2
    printf "%.6g %.6g %.6g\n", med, r[1], r[m] }'
}

# The commit whose code a benchmark measures (src/, benches/, Cargo files), or "dirty" when they
# differ from HEAD. The benchmark scripts record it next to their results (target/bench-*.rev),
# and `scripts/bench --report` only writes a report from results of the code HEAD has.
MEASURED_PATHS=(src benches Cargo.toml Cargo.lock)
measured_rev() {
  if git diff --quiet HEAD -- "${MEASURED_PATHS[@]}"; then git rev-parse HEAD; else echo dirty; fi
}
measures_head() { # rev file -> success when the recorded run measured the code HEAD has
  local rev
  rev=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$rev" ] && [ "$rev" != dirty ] && git diff --quiet "$rev" HEAD -- "${MEASURED_PATHS[@]}"
}
