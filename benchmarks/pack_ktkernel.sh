#!/usr/bin/env bash
# Pack the CPU-only part of kt-kernel (ktransformers' MoE kernel) into a small tarball for
# benchmarks/bench_ktkernel.py.
#
# The kt-kernel wheel is ~100 MB (it bundles sgl-kernel, deep_gemm, flash-attn, mscclpp, ...)
# and pins torch==2.9.1; its CPU MoE path needs none of that. What it needs is one pybind11
# extension per ISA build (kt_kernel/_kt_kernel_ext_<variant>.cpython-3XX-x86_64-linux-gnu.so),
# which links no libtorch/libc10 -- only libstdc++, libc/libm and the auditwheel-vendored
# libnuma/libgomp/libhwloc/libmvec/libudev in kt_kernel.libs/ (found through
# RPATH=$ORIGIN/../kt_kernel.libs) -- plus the wheel's own ISA picker (kt_kernel/_cpu_detect.py,
# plain Python). So the tarball holds exactly that layout:
#
#   kt_kernel/_kt_kernel_ext_<variant>.cpython-3XX-x86_64-linux-gnu.so   (one per --variants)
#   kt_kernel/_cpu_detect.py
#   kt_kernel.libs/*.so*
#   kt_kernel-<ver>.dist-info/METADATA                                    (provenance, licence)
#   KTK_MANIFEST.txt                                                      (wheel name, sha256, files)
#
# and is unpacked onto a temporary directory by bench_ktkernel.py --tarball (no pip, no deps).
#
# Usage:
#   bash benchmarks/pack_ktkernel.sh                 # cp312 wheel (the remote: Python 3.12)
#   bash benchmarks/pack_ktkernel.sh --cp311         # cp311 wheel, for testing on Python 3.11
#   bash benchmarks/pack_ktkernel.sh --wheel PATH    # a wheel you already have (tag read from its name)
#   bash benchmarks/pack_ktkernel.sh --variants all  # every ISA build (~4.1 MiB instead of ~2.5 MiB)
#   bash benchmarks/pack_ktkernel.sh --out FILE      # default .ktk/kt_kernel_cpu.tar.xz (cp312),
#                                                    #         .ktk/kt_kernel_cpu_cp311.tar.xz (--cp311)
# Without --wheel it looks in /tmp/ktk312 (cp312) or /tmp/ktk (cp311) and otherwise downloads it:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_35_x86_64 kt-kernel==$KTK_VERSION -d /tmp/ktk312
#
# Variants in the wheel (0.7.2): amx, avx512_bf16, avx512_vbmi, avx512_vnni, avx512_base, avx2.
# The default packs "amx avx512_bf16": amx for a Sapphire-Rapids-or-later Xeon, avx512_bf16 for
# AVX-512-BF16 hosts without AMX (Zen 4/5, and as an A/B on the Xeon via
# KT_KERNEL_CPU_VARIANT=avx512_bf16).
set -euo pipefail

KTK_VERSION="${KTK_VERSION:-0.7.2}"
PYTAG=312
WHEEL=""
VARIANTS="amx avx512_bf16"
OUT=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --cp311) PYTAG=311; shift ;;
    --cp312) PYTAG=312; shift ;;
    --wheel) WHEEL="$2"; shift 2 ;;
    --variants) VARIANTS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$VARIANTS" == "all" ]] && VARIANTS="amx avx512_bf16 avx512_vbmi avx512_vnni avx512_base avx2"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "$WHEEL" ]]; then
  # The wheel's own tag decides the Python version of the extension.
  case "$(basename "$WHEEL")" in
    *-cp311-*) PYTAG=311 ;;
    *-cp312-*) PYTAG=312 ;;
    *-cp313-*) PYTAG=313 ;;
    *-cp310-*) PYTAG=310 ;;
  esac
fi
if [[ -z "$OUT" ]]; then
  if [[ "$PYTAG" == 312 ]]; then OUT="$REPO/.ktk/kt_kernel_cpu.tar.xz"; else OUT="$REPO/.ktk/kt_kernel_cpu_cp$PYTAG.tar.xz"; fi
fi

if [[ -z "$WHEEL" ]]; then
  if [[ "$PYTAG" == 311 ]]; then DL=/tmp/ktk; else DL="/tmp/ktk$PYTAG"; fi
  WHEEL="$(ls "$DL"/kt_kernel-"$KTK_VERSION"-cp"$PYTAG"-cp"$PYTAG"-manylinux*_x86_64.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$WHEEL" ]]; then
    echo "downloading kt-kernel==$KTK_VERSION for cp$PYTAG into $DL ..." >&2
    mkdir -p "$DL"
    python3 -m pip download --no-deps --only-binary=:all: --python-version "3.${PYTAG#3}" \
      --platform manylinux_2_35_x86_64 "kt-kernel==$KTK_VERSION" -d "$DL" >&2
    WHEEL="$(ls "$DL"/kt_kernel-"$KTK_VERSION"-cp"$PYTAG"-cp"$PYTAG"-manylinux*_x86_64.whl | head -n1)"
  fi
fi
[[ -f "$WHEEL" ]] || { echo "no wheel at $WHEEL" >&2; exit 1; }

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

# Extract only what the CPU MoE path needs (a wheel is a zip; python's zipfile is always there).
python3 - "$WHEEL" "$STAGE" "$PYTAG" $VARIANTS <<'PY'
import hashlib, os, re, sys, zipfile
wheel, stage, pytag, variants = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    want = []
    for v in variants:
        hit = [n for n in names if re.fullmatch(rf"kt_kernel/_kt_kernel_ext_{v}\.cpython-{pytag}-x86_64-linux-gnu\.so", n)]
        if not hit:
            have = sorted(n for n in names if n.startswith("kt_kernel/_kt_kernel_ext_"))
            sys.exit(f"variant {v!r} (cp{pytag}) is not in {os.path.basename(wheel)}; it has: {have}")
        want += hit
    want.append("kt_kernel/_cpu_detect.py")
    want += [n for n in names if n.startswith("kt_kernel.libs/") and not n.endswith("/")]
    want += [n for n in names if re.fullmatch(r"kt_kernel-[^/]+\.dist-info/METADATA", n)]
    for n in want:
        z.extract(n, stage)
h = hashlib.sha256()
with open(wheel, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
with open(os.path.join(stage, "KTK_MANIFEST.txt"), "w") as f:
    f.write(f"wheel {os.path.basename(wheel)}\nsha256 {h.hexdigest()}\npython cp{pytag}\n")
    f.write("variants " + " ".join(variants) + "\n")
    for n in sorted(want):
        f.write(f"file {n} {os.path.getsize(os.path.join(stage, n))}\n")
PY

# No libtorch/libc10 in any extension's dynamic section: the kernel is torch-version agnostic.
for so in "$STAGE"/kt_kernel/_kt_kernel_ext_*.so; do
  if readelf -d "$so" 2>/dev/null | grep -qiE 'NEEDED.*(torch|c10)'; then
    echo "warning: $(basename "$so") links libtorch/libc10" >&2
  fi
done

mkdir -p "$(dirname "$OUT")"
(cd "$STAGE" && XZ_OPT="-9e -T0" tar cJf "$OUT" --owner=0 --group=0 --sort=name KTK_MANIFEST.txt kt_kernel kt_kernel.libs kt_kernel-*.dist-info)

# Keep .ktk/ out of git (it is carried to the device machine explicitly).
EXCLUDE="$(git -C "$REPO" rev-parse --git-path info/exclude 2>/dev/null || true)"
if [[ -n "$EXCLUDE" ]]; then
  [[ "$EXCLUDE" = /* ]] || EXCLUDE="$REPO/$EXCLUDE"
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qxF '.ktk/' "$EXCLUDE" 2>/dev/null || echo '.ktk/' >> "$EXCLUDE"
fi

echo "wheel:    $(basename "$WHEEL")"
echo "variants: $VARIANTS"
tar tJvf "$OUT" | awk '{printf "  %10d  %s\n", $3, $6}'
BYTES=$(stat -c %s "$OUT")
echo "wrote $OUT: $BYTES bytes ($(awk -v b="$BYTES" 'BEGIN{printf "%.2f", b/1048576}') MiB)"
