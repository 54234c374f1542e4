"""torchrun with its rendezvous stores listening on 127.0.0.1 only (on one machine), or on
the node's own address ($CAMPAIGN_BIND_ADDR, for a trial that spans nodes).

    python -m training.launch --standalone --nproc-per-node=2 -m training.train --config ...

takes torchrun's arguments unchanged (see training/loopback.py for why).
"""

from training.loopback import patch_torch_stores

if __name__ == "__main__":
    patch_torch_stores()
    from torch.distributed.run import main

    main()
