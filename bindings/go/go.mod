module smartgen

go 1.19
