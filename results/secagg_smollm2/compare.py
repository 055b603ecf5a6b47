import json, sys
import numpy as np
from safetensors.numpy import load_file
a, b = (load_file(f"{d}/adapter/adapter_model.safetensors") for d in sys.argv[1:3])
diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
scale = max(float(np.max(np.abs(b[k]))) for k in b)
out = {"max_abs_diff": diff, "max_abs_entry_plain": scale, "tensors": len(a), "same_keys": sorted(a) == sorted(b)}
print(json.dumps(out))
