#!/usr/bin/env python3
# KL divergence of each KV cache type against the f16 cache on the f32 fixtures (docs/kv-cache.md):
# fitmoe logits over prompt p200 on the CPU with flash attention, per type pair. Plain Python, no numpy.
# Usage: scripts/kv-quality.py   (FITMOE=path to the binary, TESTDATA=../shared/testdata)
import json, subprocess, sys, math, array, statistics
import os
TD=os.environ.get('TESTDATA', os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'testdata'))
FM=os.environ.get('FITMOE', os.path.join(os.path.dirname(__file__), '..', 'build', 'fitmoe'))
rows=[]
print("| model | K/V | KL mean | KL median | KL p99 | same top token |\n|---|---|---:|---:|---:|---:|")
for folder in ['qwen3moe-tiny','qwen35moe-tiny','gemma4-tiny','gemma4moe-tiny']:
    m=json.load(open(f'{TD}/{folder}/manifest.json'))
    ids=m['prompts']['p200']['ids']
    tok=','.join(map(str,ids))
    model=f'{TD}/{folder}/{folder}-f32.gguf'
    def run(k,v,fa):
        out=f'/tmp/kl-{folder}-{k}-{v}-{fa}.f32'
        r=subprocess.run([FM,'logits','-m',model,'--gpu','none','--tokens',tok,'-o',out,'-ctk',k,'-ctv',v,'-fa',fa,'-c','256'],capture_output=True,text=True)
        if r.returncode: print(r.stderr); sys.exit(1)
        a=array.array('f'); a.frombytes(open(out,'rb').read()); V=len(a)//len(ids)
        return [a[i*V:(i+1)*V] for i in range(len(ids))]
    def ls(row):
        mx=max(row); z=math.log(sum(math.exp(x-mx) for x in row)); return [x-mx-z for x in row]
    base=[ls(r) for r in run('f16','f16','on')]
    for k,v in [('f32','f32'),('bf16','bf16'),('q8_0','q8_0'),('q4_0','q4_0'),('q8_0','q4_0'),('tq4','tq4'),('tq3','tq3'),('tq2','tq2'),('q8_0','tq3')]:
        other=[ls(r) for r in run(k,v,'on')]
        kls=[];same=0
        for a,b in zip(base,other):
            kls.append(sum(math.exp(x)*(x-y) for x,y in zip(a,b)))
            same+= a.index(max(a))==b.index(max(b))
        kls.sort()
        print(f'| {folder} | {k}/{v} | {statistics.mean(kls):.2e} | {kls[len(kls)//2]:.2e} | {kls[int(0.99*len(kls))]:.2e} | {same/len(kls):.3f} |',flush=True)
