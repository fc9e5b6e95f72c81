# probe only (session 20): every Python process of a command moves the counted prefix's threshold
import os
if os.environ.get("CCE_PREFIX_AT"):
    from cce_inductor import _counted_share as S
    S.COUNTED_PREFIX_AT_MOST = float(os.environ["CCE_PREFIX_AT"])
