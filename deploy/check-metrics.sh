#!/usr/bin/env bash
# Lints a live collabserve /metrics page with promtool (naming, units, help texts, histogram shape).
#   deploy/check-metrics.sh [URL]     default URL: http://127.0.0.1:9090/metrics
# Exits non-zero when the page cannot be fetched or promtool reports a problem. Needs curl and
# promtool (Debian packages curl and prometheus; scripts/install-deps.sh installs both).
set -euo pipefail
url=${1:-http://127.0.0.1:9090/metrics}
for tool in curl promtool; do
  command -v "$tool" >/dev/null 2>&1 || { echo "check-metrics: $tool not found (run scripts/install-deps.sh)" >&2; exit 2; }
done
page=$(mktemp)
trap 'rm -f "$page"' EXIT
if ! curl -fsS --max-time 10 -o "$page" "$url"; then
  echo "check-metrics: cannot fetch $url" >&2
  exit 1
fi
if ! grep -q '^collabserve_' "$page"; then
  echo "check-metrics: $url has no collabserve_ metric" >&2
  exit 1
fi
# promtool prints lint findings and exits 3 on them; 1 on a parse error.
if ! out=$(promtool check metrics < "$page" 2>&1); then
  echo "check-metrics: promtool check metrics failed for $url:" >&2
  echo "$out" >&2
  exit 1
fi
[ -z "$out" ] || { echo "check-metrics: promtool findings for $url:" >&2; echo "$out" >&2; exit 1; }
echo "check-metrics: $url OK ($(grep -c '^# TYPE' "$page") metric families)"
