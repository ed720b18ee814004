"""A run's contract: everything that can change a result. Its configuration
(``config``: RunConfig and the settings a request passes into it), the machine and
libraries it ran on (``environment``), the exact versions of every distribution and
their pins (``lock``), how a contract is built (``build``) and how one recorded in an
older layout is read (``upgrade``). Above the backends, whose settings it holds; below
everything that runs or audits a run."""
