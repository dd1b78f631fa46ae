#include "ResolverPlugin.h"

#include "dhisparse/kernels.h"
#include "dhisparse/resolver.h"

namespace dhisparse
{
namespace trt
{

using nvinfer1::DataType;

ResolverPlugin::ResolverPlugin(int32_t page_rows)
    : mPageRows(page_rows)
{
    require(page_rows > 0, "page_rows must be > 0");
}

ResolverPlugin ResolverPlugin::create(nvinfer1::PluginFieldCollection const* fc)
{
    return ResolverPlugin(FieldReader(fc).get_int32("page_rows", 0));
}

void ResolverPlugin::describe_fields(FieldList& fields)
{
    fields.add("page_rows", static_cast<int32_t const*>(nullptr));
}

void ResolverPlugin::list_fields(FieldList& fields) const
{
    fields.add("page_rows", &mPageRows);
}

int32_t ResolverPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t ResolverPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/, int32_t nbInputs) const noexcept
{
    if (nbOutputs != kNbOutputs || nbInputs != kNbInputs)
    {
        return -1;
    }
    for (int32_t i = 0; i < kNbOutputs; ++i)
    {
        outputTypes[i] = i == 1 ? DataType::kINT8 : DataType::kINT32;
    }
    return 0;
}

int32_t ResolverPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[0].nbDims != 2 || inputs[2].nbDims != 2)
    {
        return -1;
    }
    for (int32_t i : {0, 1, 4, 5, 6})
    {
        outputs[i] = inputs[0];  // [R, N]
    }
    outputs[2] = inputs[2];  // [R, B]
    outputs[3] = inputs[2];
    outputs[7].nbDims = 2;
    outputs[7].d[0] = inputs[0].d[0];
    outputs[7].d[1] = exprBuilder.constant(kSummaryColumns);
    return 0;
}

bool ResolverPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
    {
        return false;
    }
    return is_linear(inOut, pos, pos == kNbInputs + 1 ? DataType::kINT8 : DataType::kINT32);
}

size_t ResolverPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t /*nbInputs*/,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return cuda::resolver_workspace_bytes(inputs[0].max.d[0], inputs[0].max.d[1], inputs[2].max.d[1], 4);
}

int32_t ResolverPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* workspace, cudaStream_t stream) noexcept
{
    cuda::ResolverArgs const args{inputDesc[0].dims.d[0], inputDesc[0].dims.d[1], inputDesc[1].dims.d[1],
        inputDesc[2].dims.d[1], mPageRows, 4, 0, inputs[5], inputs[0], inputs[1], inputs[2], inputs[3], inputs[4],
        outputs[0], static_cast<int8_t*>(outputs[1]), outputs[2], outputs[3], outputs[4], outputs[5], outputs[6],
        static_cast<int32_t*>(outputs[7])};
    return cuda::launch_resolver(args, workspace, stream) == cudaSuccess ? 0 : -1;
}

} // namespace trt
} // namespace dhisparse
