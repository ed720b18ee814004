"""``kvreplay audit``, split by what it checks: the request (``request``), the contract,
header and items (``contract``), what the rows must be from the config alone (``plan``),
each row as it reads (``rows``, ``consistency``, ``snapshots``), the folder's other files
(``files``), the rows run again (``reexecute``), and the order they run in (``audit``)."""
