"""What every experiment plugs into (design: experiments): its declaration
(``declaration``) and base class (``experiment``), the scope and selection it runs on
(``scope``, ``selection``, ``prefixes``), its units (``units``), its arms and the
executors that run them in process (``panel``, ``executor``, ``blocks``) or as requests
to a server (``served``, ``requests``), its typed rows (``rows``), its CSV declared once
(``table``, ``columns``) and the shape of its analysis section (``section``). No
experiment is named here; the experiments are packages of ``kvreplay.experiments``."""
