# shellcheck shell=bash
# machine_debian_uri: the Debian archive URI the machine's apt already uses (deb822 or one-line
# format), for the private apt states of the kernel lane and the images' base. Sourced.
machine_debian_uri() {
  local uri=""
  if [[ -r /etc/apt/sources.list.d/debian.sources ]]; then
    uri=$(awk '/^URIs:/ && $2 !~ /-security/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
  fi
  if [[ -z $uri && -r /etc/apt/sources.list ]]; then
    uri=$(awk '$1 == "deb" && $0 !~ /-security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)
  fi
  [[ -n $uri ]] || { echo "cannot find the Debian archive URI in the machine's apt sources" >&2; return 1; }
  printf '%s\n' "$uri"
}
