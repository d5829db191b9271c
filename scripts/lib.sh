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

# Mean time in ns of criterion benchmark group/function/param, or "nan" when it is missing.
criterion_mean() {
  local f="target/criterion/$1/new/estimates.json"
  [ -f "$f" ] || { echo "criterion: missing $f" >&2; echo nan; return; }
  grep -o '"mean":{[^}]*}[^}]*}' "$f" | grep -o '"point_estimate":[0-9.e+-]*' | head -1 | cut -d: -f2
}
