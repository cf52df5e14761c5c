# Sourced by build-gpu-wheel.sh and gpu-check.sh: a digest of the files the
# wheel is built from, as they are in the checkout at $ROOT. The build
# records it in wheelhouse/BUILD-INFO; gpu-check.sh refuses a wheel whose
# digest is not the checkout's, so that device time is never spent on code
# older than the checkout (wheelhouse/ is git-ignored and outlives commits).
#
# The files are those that travel to the device: tracked or untracked but
# not ignored (git ls-files -co --exclude-standard) where git works, else
# every file under the same paths (the device's copy has no ignored files
# there).
GMP_SOURCE_PATHS=(bindings gocore gpumempool setup.py pyproject.toml go.mod go.sum MANIFEST.in)

source_digest() {
  (
    cd "$ROOT" || exit 1
    # NUL-separated names: git would quote unusual ones ("\303\251.py"),
    # which then name no file
    if git rev-parse --git-dir >/dev/null 2>&1; then
      git ls-files -z -co --exclude-standard -- "${GMP_SOURCE_PATHS[@]}"
    else
      find "${GMP_SOURCE_PATHS[@]}" -type f ! -path '*/__pycache__/*' -print0 2>/dev/null
    fi | LC_ALL=C sort -zu | while IFS= read -r -d '' f; do
      if [[ -f "$f" ]]; then printf '%s  %s\n' "$(sha256sum <"$f" | cut -c1-64)" "$f"; fi
    done | sha256sum | cut -c1-16
  )
}
