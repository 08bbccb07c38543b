# dev/gpu/fast_tolerance.awk: fast mode (bf16) against a reference within the bf16 tolerances
# that dev/gpu/check.sh's header derives (u = 2^-8, K = 4L + 2 roundings per path, N = B*T
# positions, S = 6 sigma, Z = 1). The one definition of those formulas: check.sh's stage 2 on a
# GPU and dev/test/test_fast_e2e.sh on the emulated GPU both run it.
#
#   awk -v L=layers -v N=B*T -v drift=TABLEFILE -f dev/gpu/fast_tolerance.awk SCALE REF GOT
#
# SCALE: the CPU's main.log (its losses l_s scale the drift); REF, GOT: the two main.logs
# compared. Prints "S0 ok|bad DETAIL" (step 0), "DRIFT ok|bad DETAIL" (every later step) and
# "FINAL LOSS" (GOT's last train loss); the per-step table, each tolerance beside the measured
# difference, goes to TABLEFILE.
function abs(x) { return x < 0 ? -x : x }
function val(k,   i) { for (i = 2; i <= NF; i++) if (index($i, k ":") == 1) return substr($i, length(k) + 2); return "" }
function num(v) { return v ~ /^[-+]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$/ }
BEGIN {
  S = 6; Z = 1
  u = 1 / 256; rho = u / (2 * sqrt(3)); K = 4 * L + 2
  sf = rho * sqrt(K); sb = rho * sqrt(2 * K)
  tl0 = S * sf * Z / sqrt(N); tn0 = S * sb / sqrt(N)
  last = -1
}
FNR == 1 { f++ }
{ s = substr($1, 3) + 0; tr = val("trl"); te = val("tel") }
f == 1 { if (tr != "") sl[s] = tr; next }
f == 2 { if (tr != "") { rl[s] = tr; rn[s] = val("norm"); rlr[s] = val("lr"); if (s > last) last = s } else if (te != "") rv[s] = te; next }
f == 3 { if (tr != "") { gl[s] = tr; gn[s] = val("norm"); glr[s] = val("lr"); glast = s } else if (te != "") gv[s] = te }
END {
  printf "# u=2^-8 rho=%.3g L=%d K=%d N=%d S=%d Z=%d: tol_loss0=%.3g nats, tol_norm0=%.3g relative\n", rho, L, K, N, S, Z, tl0, tn0 > drift
  printf "# tol_loss(s) = tol_loss0 + tol_norm0 sqrt(s) (l0 - l_s); tol_norm(s) = tol_norm0 + (tol_loss(s) - tol_loss0) / min(l_s, 1)\n" > drift
  printf "# step   ref_loss    loss       |d|       tol    d/tol |   ref_norm       norm     rel_d       tol  d/tol   l_s(CPU)\n" > drift
  l0 = sl[0]; wl = wn = -1; over = missing = nonnum = lrbad = steps = 0; ok0 = 0; d0 = "no step 0"
  if (last < 0 || !num(l0)) { print "S0 bad the reference log has no steps"; print "DRIFT bad no reference"; print "FINAL nan"; exit }
  for (s = 0; s <= last; s++) {
    if (!(s in rl)) continue
    if (!(s in gl)) { missing++; continue }
    if (!num(gl[s]) || !num(gn[s]) || !num(rl[s]) || !num(rn[s])) { nonnum++; continue }
    if (glr[s] != rlr[s]) lrbad++
    dl = abs(gl[s] - rl[s]); dn = abs(gn[s] - rn[s]) / (rn[s] != 0 ? abs(rn[s]) : 1)
    ls = (s in sl) ? sl[s] + 0 : rl[s] + 0
    grow = s == 0 ? 0 : tn0 * sqrt(s) * (l0 - ls > 0 ? l0 - ls : 0)
    tl = tl0 + grow; tn = tn0 + grow / (ls < 1 && ls > 0 ? ls : 1)
    printf "%6d %10.6f %10.6f %9.2e %9.2e %5.2f | %10.4f %10.4f %9.2e %9.2e %5.2f %10.6f\n", s, rl[s], gl[s], dl, tl, dl / tl, rn[s], gn[s], dn, tn, dn / tn, ls > drift
    if (s == 0) {
      ok0 = dl <= tl && dn <= tn
      d0 = sprintf("loss |d| %.1e (tol %.1e), norm rel %.1e (tol %.1e)", dl, tl, dn, tn)
      continue
    }
    steps++
    if (dl > tl || dn > tn) over++
    if (wl < 0 || dl / tl > wlr) { wl = s; wlr = dl / tl; wld = dl; wlt = tl }
    if (wn < 0 || dn / tn > wnr) { wn = s; wnr = dn / tn; wnd = dn; wnt = tn }
  }
  if ((0 in rv) && (0 in gv) && num(gv[0])) {
    dv = abs(gv[0] - rv[0]); ok0 = ok0 && dv <= tl0
    d0 = d0 sprintf(", val |d| %.1e (tol %.1e)", dv, tl0)
  } else if (0 in rv) { ok0 = 0; d0 = d0 ", no val loss at step 0" }
  for (s in rv) if (s != 0 && (s in gv)) printf "# val loss at step %d: reference %s, compared %s, |d| %.2e\n", s, rv[s], gv[s], abs(gv[s] - rv[s]) > drift
  print "S0", ok0 ? "ok" : "bad", d0
  ok = over == 0 && missing == 0 && nonnum == 0 && lrbad == 0 && steps > 0
  printf "DRIFT %s %d steps: worst loss %.2f of tol at step %d (|d| %.1e, tol %.1e), worst norm %.2f of tol at step %d (rel %.1e, tol %.1e); %d over tol, %d missing, %d not numbers, %d lr differ\n", ok ? "ok" : "bad", steps, wlr, wl, wld, wlt, wnr, wn, wnd, wnt, over, missing, nonnum, lrbad
  print "FINAL", (glast == last && num(gl[last])) ? gl[last] : "missing"
}
