#!/usr/bin/env bash
# Runs each test given on the command line (an executable or script path, with optional
# arguments separated by ':' e.g. dev/test/foo.sh:arg), prints PASS/FAIL per test with its
# time and a summary table, and exits non-zero if any test failed. Output of a failing test is
# shown in full; output of a passing one is kept in build/test-logs/.
set -u
mkdir -p build/test-logs
fails=()
summary=""
for t in "$@"; do
  cmd=${t//:/ }
  name=$(basename "${t%%:*}")${t#"${t%%:*}"}
  name=${name//:/_}
  log="build/test-logs/${name}.log"
  start=$(date +%s)
  if $cmd >"$log" 2>&1; then
    status=PASS
  else
    status=FAIL
    fails+=("$name")
  fi
  secs=$(( $(date +%s) - start ))
  printf '%-4s %4ds  %s\n' "$status" "$secs" "$cmd"
  if [ "$status" = FAIL ]; then
    echo "----- output of $cmd -----"
    cat "$log"
    echo "----- end of $cmd -----"
  fi
  summary+=$(printf '%-4s %4ds  %s' "$status" "$secs" "$name")$'\n'
done
echo
echo "== test summary =="
printf '%s' "$summary"
if [ ${#fails[@]} -ne 0 ]; then
  echo "FAILED: ${#fails[@]} of $# tests: ${fails[*]}"
  exit 1
fi
echo "all $# tests passed"
