"""torchrun with its rendezvous stores listening on 127.0.0.1 only (on one machine), or on
the node's own address ($CAMPAIGN_BIND_ADDR, for a trial that spans nodes).

    python -m training.launch --standalone --nproc-per-node=2 -m training.train --config ...

takes torchrun's arguments unchanged (see training/loopback.py for why).
"""

from training.loopback import patch_torch_stores
from training.process import skip_final_collection

if __name__ == "__main__":
    skip_final_collection()  # a trial's end is seen when torchrun has exited
    patch_torch_stores()
    from torch.distributed.run import main

    main()
