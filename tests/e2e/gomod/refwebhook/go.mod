module gpufence.test/e2e/refwebhook

go 1.22
