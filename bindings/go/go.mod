module github.com/smartgen/smartgen/bindings/go

go 1.19
