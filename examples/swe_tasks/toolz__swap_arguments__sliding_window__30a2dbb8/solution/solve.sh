#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -672,7 +672,7 @@
     >>> list(map(mean, sliding_window(2, [1, 2, 3, 4])))
     [1.5, 2.5, 3.5]
     """
-    return zip(*(collections.deque(itertools.islice(it, i), 0) or it
+    return zip(*(collections.deque(0, itertools.islice(it, i)) or it
                for i, it in enumerate(itertools.tee(seq, n))))
 
 
SLIME_ENV_SWE_PATCH
