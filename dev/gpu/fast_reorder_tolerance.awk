# dev/gpu/fast_reorder_tolerance.awk: a fast-mode run (bf16) whose layout reorders some fp32
# sums against the same fast run on one rank, within the tolerance those reorderings allow
# (dev/test/test_fast_tp.sh, test_fast_cp.sh and test_fast_moe.sh derive their K in their
# headers; the formula is written once, here):
#
#   awk -v S=6 -v u=0.00390625 -v n=TERMS -v K=ROUNDINGS -v Kname=K_tp -v N=POSITIONS [-v exact0=1] \
#       -f dev/gpu/fast_reorder_tolerance.awk REF GOT
#
# A reordered fp32 sum of n terms moves by at most n 2^-24 relative, so a bf16 rounding of it
# comes out one bf16 ulp (u relative) apart with probability p <= n 2^-24 / u; K such roundings
# on a path, N positions a step, S sigma:
#   |d loss| <= tol = S u sqrt(p K / N)          (every step's train loss, the validation losses)
#   rel |d norm| <= tol sqrt(2)                   (forward and backward)
# plus fast_tolerance.awk's growth over later steps (tol_norm0 sqrt(s) (l_0 - l_s)). exact0=1:
# step 0's train loss and the validation loss before any update must be REF's bits (a layout
# whose forward is one rank's arithmetic). REF, GOT: the two main.logs. Prints one line:
# "ok DETAIL" or "bad WHAT: DETAIL".
function abs(x) { return x < 0 ? -x : x }
function val(k,   i) { for (i = 2; i <= NF; i++) if (index($i, k ":") == 1) return substr($i, length(k) + 2); return "" }
FNR == 1 { f++ }
{ s = substr($1, 3) + 0; tr = val("trl"); te = val("tel") }
tr != "" { l[f, s] = tr; nm[f, s] = val("norm"); if (f == 1) last = s }
te != "" { v[f, s] = te; if (f == 1) vs[s] = 1 }
END {
  p = n * 2 ^ -24 / u; tol = S * u * sqrt(p * K / N); tn = tol * sqrt(2); worst = 0; bad = ""
  if (exact0 && l[2, 0] != l[1, 0]) bad = bad sprintf(" step 0 loss %s vs %s (the forward is not one rank's)", l[2, 0], l[1, 0])
  if (exact0 && v[2, 0] != v[1, 0]) bad = bad sprintf(" val loss at step 0 %s vs %s (the forward is not one rank's)", v[2, 0], v[1, 0])
  for (s = 0; s <= last; s++) {
    if (!((2, s) in l)) { bad = bad " step " s " missing"; continue }
    grow = tn * sqrt(s) * (l[1, 0] - l[1, s] > 0 ? l[1, 0] - l[1, s] : 0)
    dl = abs(l[2, s] - l[1, s]) / (tol + grow); dn = abs(nm[2, s] - nm[1, s]) / abs(nm[1, s]) / (tn + grow)
    if (dl > 1) bad = bad sprintf(" step %d loss %s vs %s", s, l[2, s], l[1, s])
    if (dn > 1) bad = bad sprintf(" step %d norm %s vs %s", s, nm[2, s], nm[1, s])
    if (dl > worst) worst = dl; if (dn > worst) worst = dn
  }
  for (s in vs) {
    dv = abs(v[2, s] - v[1, s]) / tol
    if (!((2, s) in v) || dv > 1) bad = bad sprintf(" val loss at step %d %s vs %s", s, v[2, s], v[1, s])
    if (dv > worst) worst = dv
  }
  printf "%s tol %.2e nats (p %.1e, %s %d), worst difference %.2g of it\n", bad == "" ? "ok" : "bad" bad ":", tol, p, Kname, K, worst
}
