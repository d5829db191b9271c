# Shared by the project's scripts: `. scripts/lib.sh` (from the repository root).

# The host's distribution, from /etc/os-release: OS_ID (debian, ubuntu, ...), OS_VERSION_ID (12,
# 24.04, ...), OS_CODENAME (bookworm, jammy, ...; Ubuntu's for its derivatives), OS_NAME, and
# OS_FAMILY: ubuntu, debian (ID or ID_LIKE) or other. Package names below are Debian's; deb_name
# maps the few that differ.
OS_ID="" OS_LIKE="" OS_VERSION_ID="" OS_CODENAME="" OS_NAME=""
if [ -r /etc/os-release ]; then
  eval "$(. /etc/os-release; printf 'OS_ID=%q OS_LIKE=%q OS_VERSION_ID=%q OS_CODENAME=%q OS_NAME=%q\n' \
    "${ID:-}" "${ID_LIKE:-}" "${VERSION_ID:-}" "${UBUNTU_CODENAME:-${VERSION_CODENAME:-}}" "${PRETTY_NAME:-}")"
fi
case " $OS_ID $OS_LIKE " in
  *" ubuntu "*) OS_FAMILY=ubuntu ;;
  *" debian "*) OS_FAMILY=debian ;;
  *) OS_FAMILY=other ;;
esac

# Runs "$@" with the sbin directories on PATH (a user's PATH often lacks them: modprobe, depmod).
sbin() { PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" "$@"; }
have() { sbin command -v "$1" >/dev/null 2>&1; }

# Root: can_root tells whether we are root or have sudo; as_root runs "$@" as root (directly, or
# through sudo), and fails saying so when neither is possible.
can_root() { [ "$(id -u)" = 0 ] || have sudo; }
as_root() {
  if [ "$(id -u)" = 0 ]; then sbin "$@"
  elif have sudo; then sudo "$@"
  else echo "error: '$*' needs root: run as root or install sudo" >&2; return 2
  fi
}

# This host's name for Debian package $1 (Ubuntu 22.04's pkg-config is in main; its pkgconf,
# in universe, conflicts with it).
deb_name() {
  case "$1:$OS_FAMILY:$OS_CODENAME" in
    pkgconf:ubuntu:jammy) echo pkg-config ;;
    *) echo "$1" ;;
  esac
}

# Whether what Debian package $1 provides is here: its command for tool packages; else dpkg's
# record, or on a host without dpkg a look for its files.
deb_present() {
  case "$1" in
    pkgconf) have pkg-config ;;
    qemu-system-x86) have qemu-system-x86_64 ;;
    kmod) have depmod && have modprobe ;;
    iproute2) have ip && have rdma ;;
    ibverbs-utils) have ibv_devinfo ;;
    perftest) have ib_write_bw ;;
    xz-utils) have xz ;;
    gnuplot-nox) have gnuplot ;;
    cpio | zstd | valgrind) have "$1" ;;
    *)
      if have dpkg-query; then
        dpkg-query -W -f='${Status}' "$(deb_name "$1")" 2>/dev/null | grep -q ' installed$'
      else
        case "$1" in
          libibverbs-dev) pkg-config --exists libibverbs 2>/dev/null ;;
          librdmacm-dev) pkg-config --exists librdmacm 2>/dev/null ;;
          libclang-dev) [ -n "${LIBCLANG_PATH:-}" ] || sbin ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so' ;;
          busybox-static) [ -x /bin/busybox ] ;;
          ibverbs-providers) compgen -G '/usr/lib*/libibverbs/librxe-rdmav*.so' >/dev/null ||
            compgen -G '/usr/lib*/*/libibverbs/librxe-rdmav*.so' >/dev/null ;;
          rdma-core) [ -e /etc/rdma ] || have rdma-ndd ;;
          *) return 1 ;;
        esac
      fi ;;
  esac
}

# What Debian package $1 provides, for hosts without apt-get.
deb_what() {
  case "$1" in
    pkgconf) echo "pkg-config" ;;
    libibverbs-dev) echo "libibverbs headers and libibverbs.pc (rdma-core's development package)" ;;
    librdmacm-dev) echo "librdmacm headers and librdmacm.pc (rdma-core's development package)" ;;
    libclang-dev) echo "libclang, clang's shared library, with its headers (bindgen loads it)" ;;
    qemu-system-x86) echo "qemu-system-x86_64" ;;
    busybox-static) echo "a statically linked /bin/busybox (copied into the VM's initramfs)" ;;
    kmod) echo "modprobe and depmod" ;;
    iproute2) echo "ip and rdma" ;;
    rdma-core) echo "rdma-core (the RDMA userspace base)" ;;
    ibverbs-providers) echo "libibverbs with its providers, rxe among them (librxe)" ;;
    ibverbs-utils) echo "ibv_devinfo" ;;
    perftest) echo "perftest (ib_write_bw, ib_read_lat, ...)" ;;
    xz-utils) echo "xz" ;;
    *) echo "$1" ;;
  esac
}

# Installs the Debian packages among "$@" that are missing, with apt-get as root or through sudo.
# Without apt-get (not Debian or Ubuntu), or without root and sudo, says what to install and
# exits 2.
ensure_debs() {
  local missing=() p
  for p in "$@"; do
    deb_present "$p" || missing+=("$(deb_name "$p")")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if ! have apt-get; then
    echo "error: this system (${OS_NAME:-unknown}) has no apt-get; install these yourself, then rerun:" >&2
    for p in "${missing[@]}"; do printf '  %-18s %s\n' "$p" "$(deb_what "$p")" >&2; done
    echo "(Debian package names; the scripts are made for Debian 12/13 and Ubuntu 22.04/24.04)" >&2
    exit 2
  fi
  can_root || { echo "error: need root or sudo to apt-get install ${missing[*]}: run as root, or install them first" >&2; exit 2; }
  echo "installing ${missing[*]}" >&2
  as_root apt-get update -qq >&2 || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || {
    echo "error: apt-get could not install ${missing[*]}" >&2
    [ "$OS_FAMILY" = ubuntu ] && echo "(on Ubuntu some, e.g. perftest, come from the universe component: add-apt-repository universe)" >&2
    exit 2
  }
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
# (tests/first_use_device.rs: its device_first_use_cost is scripts/bench-transfer's first-use part.)
MEASURED_PATHS=(src benches tests/first_use_device.rs Cargo.toml Cargo.lock)
measured_rev() {
  if git diff --quiet HEAD -- "${MEASURED_PATHS[@]}"; then git rev-parse HEAD; else echo dirty; fi
}
measures_head() { # rev file -> success when the recorded run measured the code HEAD has
  local rev
  rev=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$rev" ] && [ "$rev" != dirty ] && git diff --quiet "$rev" HEAD -- "${MEASURED_PATHS[@]}"
}
