#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4761,7 +4761,6 @@
         k = key(item) if use_key else item
         if k not in counts:
             yield item
-        counts[k] += 1
         window.append(k)
 
 
SLIME_ENV_SWE_PATCH
