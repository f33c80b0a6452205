# Sourced by build_book.sh and test.sh: the programs the browser tests need outside Python.
#
# The browser suite drives a real Chromium (never one that a tool downloads) and installs
# the local copies of the pages' CDN files with npm. GRADLAB_CHROMIUM names another
# Chromium-family browser (CI on GitHub uses its runner's Chrome).

chromium_path() {
  if [ -n "${GRADLAB_CHROMIUM:-}" ]; then
    echo "$GRADLAB_CHROMIUM"
  else
    command -v chromium || echo /usr/bin/chromium
  fi
}

# The missing programs, as Debian package names.
missing_system_deps() {
  local missing=()
  [ -x "$(chromium_path)" ] || missing+=(chromium)
  command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
  echo "${missing[@]}"
}

# On Debian or Ubuntu as root, apt-get installs what is missing; elsewhere one sentence
# says what to install, and the tests stop before they start (test.sh checks again).
install_system_deps() {
  local missing
  missing=$(missing_system_deps)
  [ -z "$missing" ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing $missing with apt-get (for the browser tests)"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "The browser tests need $missing: install them (Debian/Ubuntu: sudo apt-get" \
      "install $missing), or set GRADLAB_CHROMIUM to a Chromium or Chrome executable." >&2
  fi
}
