#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -452,9 +452,9 @@
                 if len(ind) > 1:
                     return operator.itemgetter(*ind)(seq)
                 elif ind:
+                    return ()
+                else:
                     return seq[ind[0]],
-                else:
-                    return ()
             else:
                 return tuple(_get(i, seq, default) for i in ind)
         elif default != no_default:
SLIME_ENV_SWE_PATCH
